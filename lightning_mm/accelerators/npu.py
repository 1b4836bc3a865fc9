"""NPUAccelerator: Ascend NPUs through torch_npu, imported only when the NPU accelerator is used.

Nothing here imports torch_npu at module import. ``npu_status()`` imports it on demand (to count NPUs), and asking
for ``accelerator="npu"`` without torch_npu or without a visible NPU fails when the accelerator is built, i.e. in
the ``Trainer`` constructor, before any process is started. torch.cuda is never patched: the NPU is addressed as
the ``npu`` device type through ``torch.npu``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_mm._compat import _AcceleratorRegistry
from lightning_mm.accelerators import runtime
from lightning_mm.accelerators.device_parsing import npu_device, parse_device_indices
from lightning_mm.errors import LightningMMError
from lightning_mm.npu_probe import INSTALL_HINT, VISIBLE_DEVICES, npu_status, torch_npu_version

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NPUAccelerator", "NPUUnavailableError", "npu_status", "torch_npu_version", "INSTALL_HINT"]


class NPUUnavailableError(LightningMMError, RuntimeError):
    """``accelerator="npu"`` was asked for where torch_npu or an NPU is missing."""


class NPUAccelerator(Accelerator):
    """Accelerator for Ascend NPUs (the ``npu`` device type of torch_npu), registered as ``accelerator="npu"``.

    Building it checks that torch_npu imports and that an NPU is visible, and raises
    :class:`NPUUnavailableError` saying which is missing and how to install it.
    """

    def __init__(self) -> None:
        super().__init__()
        _, reason = npu_status()
        if reason is not None:
            raise NPUUnavailableError(f"accelerator='npu' cannot be used: {reason}")

    @override
    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current NPU."""
        if device.type != "npu":
            raise MisconfigurationException(
                f"NPUAccelerator was given the device {device}; the strategy must place this process on an npu "
                "device: for one NPU pass Trainer(accelerator='npu', devices=1, strategy='single_npu'), for several "
                "strategy='mm_fsdp2' (Lightning chooses a CPU strategy for accelerators it does not ship)"
            )
        runtime.device_module(device).set_device(device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Refuse mixed precision that would autocast on another device type (before any step runs)."""
        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.device != "npu":
            raise MisconfigurationException(
                f"precision={plugin.precision!r} with accelerator='npu' would autocast on {plugin.device!r}: use "
                "strategy='single_npu' or 'mm_fsdp2' (both autocast on the NPU), or pass "
                f"plugins=[MixedPrecision({plugin.precision!r}, 'npu')]"
            )

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """Memory statistics of the NPU (``torch.npu.memory_stats``)."""
        return runtime.memory_stats(npu_device(device, "NPUAccelerator.get_device_stats"))

    @override
    def teardown(self) -> None:
        """Release the NPU allocator's cached memory."""
        if "torch_npu" in sys.modules and hasattr(torch, "npu"):
            runtime.empty_cache("npu")

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> list[int]:
        """``devices`` as NPU indices: an int, ``-1``, a list, ``"auto"``, ``"-1"``, ``"2"`` or ``"0,1"``."""
        count, reason = npu_status()
        hint = reason or f"Set {VISIBLE_DEVICES} to change which NPUs are visible."
        return parse_device_indices(devices, count, name="NPU", hint=hint)

    @staticmethod
    @override
    def get_parallel_devices(devices: int | list[int]) -> list[torch.device]:
        """One ``npu`` device per index (an int ``n`` means the first ``n``)."""
        indices = range(devices) if isinstance(devices, int) else devices
        return [torch.device("npu", i) for i in indices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        """The number of visible NPUs."""
        return npu_status()[0]

    @staticmethod
    @override
    def is_available() -> bool:
        """Whether torch_npu imports and at least one NPU is visible (never raises)."""
        return npu_status()[0] > 0

    @staticmethod
    @override
    def name() -> str:
        return "npu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        """Register ``accelerator="npu"``; nothing else in Lightning changes (``accelerator="auto"`` never picks the
        NPU, and one NPU is ``strategy="single_npu"``)."""
        if cls.name() not in accelerator_registry:
            accelerator_registry.register(cls.name(), cls, description="Ascend NPU through torch_npu")
