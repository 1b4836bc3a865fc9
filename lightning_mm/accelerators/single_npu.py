"""SingleNPUStrategy: training on one Ascend NPU, registered as ``strategy="single_npu"``.

Lightning picks a single-device strategy only for the accelerators it ships (for any other one it falls back to
``SingleDeviceStrategy("cpu")``) and autocasts mixed precision on ``"cuda"``. Rather than changing Lightning's
accelerator connector, this strategy is asked for by name, as lightning-Habana's HPU strategies are:

    Trainer(accelerator="npu", devices=[1], strategy="single_npu", precision="bf16-mixed")

It takes its device from ``Trainer(devices=...)`` (or ``device=``), and runs mixed precision on the ``npu``
autocast device. Nothing here imports torch_npu.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_mm.accelerators.device_parsing import npu_device
from lightning_mm.errors import ConfigError

__all__ = ["SingleNPUStrategy"]

_NEEDED_BY = "SingleNPUStrategy"


class SingleNPUStrategy(SingleDeviceStrategy):
    """One NPU (``npu:0`` unless ``device`` or ``Trainer(devices=...)`` says otherwise)."""

    strategy_name = "single_npu"

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io)
        self._npu: torch.device | None = None if device is None else npu_device(device, _NEEDED_BY)
        self.precision_plugin = precision_plugin

    @property
    @override
    def root_device(self) -> torch.device:
        return self._npu if self._npu is not None else torch.device("npu", 0)

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The one device; Lightning's connector fills it in from ``Trainer(devices=...)`` when it is unset."""
        return [self._npu] if self._npu is not None else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if not devices:
            return
        if len(devices) != 1:
            raise ConfigError(
                f"strategy='single_npu' runs on one NPU, but {len(devices)} devices were asked for "
                f"({[str(d) for d in devices]}); use strategy='mm_fsdp2' (or 'ddp') for several"
            )
        self._npu = npu_device(devices[0], _NEEDED_BY)

    @property
    @override
    def precision_plugin(self) -> Precision:
        return SingleDeviceStrategy.precision_plugin.fget(self)  # type: ignore[attr-defined]

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning builds MixedPrecision(..., "cuda") for every accelerator but CPU and MPS: autocast on the NPU.
        if type(precision_plugin) is MixedPrecision and precision_plugin.device != "npu":
            # MixedPrecision's precision is one its constructor took; Precision's annotation is the wider union.
            precision_plugin = MixedPrecision(precision_plugin.precision, "npu")  # type: ignore[arg-type]
        SingleDeviceStrategy.precision_plugin.fset(self, precision_plugin)  # type: ignore[attr-defined]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="One Ascend NPU")
