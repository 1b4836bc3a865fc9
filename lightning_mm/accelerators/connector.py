"""Teach Lightning's accelerator connector about the NPU, the way it knows CUDA.

Lightning's ``_AcceleratorConnector`` (lightning/pytorch/trainer/connectors/accelerator_connector.py) hard-codes
three choices for accelerators it ships, and has no hook for an out-of-tree one:

* ``accelerator="auto"`` only considers TPU, MPS, CUDA and CPU;
* ``devices=1`` with any other accelerator falls back to ``SingleDeviceStrategy("cpu")``;
* ``precision="16-mixed"/"bf16-mixed"`` autocasts on ``"cuda"`` for any accelerator but CPU and MPS.

:func:`install` wraps those three methods of the connector class with an NPU branch (what Lightning does for CUDA:
``auto`` picks the NPU when CPU would be chosen and an NPU is visible; one NPU gets
``SingleDeviceStrategy(npu:i)``; mixed precision autocasts on ``"npu"``). For every other accelerator the
original method runs unchanged. It is installed once, when ``lightning_mm`` registers the NPU accelerator; it
never imports torch_npu (availability is checked only when ``accelerator="auto"`` is resolved).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

__all__ = ["install", "is_installed"]

_MARK = "_lightning_mm_npu_branches"
_METHODS = ("_choose_auto_accelerator", "_choose_strategy", "_check_and_init_precision")


def is_installed() -> bool:
    """Whether the connector has the NPU branches."""
    return bool(getattr(_AcceleratorConnector, _MARK, False))


def _is_npu(flag: Any) -> bool:
    from lightning_mm.accelerators.npu import NPUAccelerator

    return flag == "npu" or isinstance(flag, NPUAccelerator)


def install() -> bool:
    """Add the NPU branches to Lightning's accelerator connector (idempotent).

    Returns ``False``, changing nothing, if this Lightning version lacks one of the methods extended here; then
    ``accelerator="npu"`` still works with an explicit strategy, and NPUAccelerator rejects a CPU placement.
    """
    cls = _AcceleratorConnector
    if is_installed():
        return True
    if not all(callable(getattr(cls, name, None)) for name in _METHODS):
        return False
    choose_auto = cls._choose_auto_accelerator
    choose_strategy = cls._choose_strategy
    init_precision = cls._check_and_init_precision

    def _choose_auto_accelerator() -> str:
        choice = choose_auto()
        if choice == "cpu":
            from lightning_mm.accelerators.npu import NPUAccelerator

            if NPUAccelerator.is_available():
                return "npu"
        return choice

    def _choose_strategy(self: _AcceleratorConnector) -> Any:
        if _is_npu(self._accelerator_flag) and self._num_nodes_flag == 1 and len(self._parallel_devices) == 1:
            return SingleDeviceStrategy(device=self._parallel_devices[0])
        return choose_strategy(self)

    def _check_and_init_precision(self: _AcceleratorConnector) -> Any:
        if not _is_npu(self._accelerator_flag):
            return init_precision(self)
        with warnings.catch_warnings():
            # For 16-mixed, Lightning first builds a CUDA GradScaler, which warns that CUDA is missing; it is
            # replaced by an NPU one just below.
            warnings.filterwarnings("ignore", message=".*GradScaler is enabled, but CUDA is not available.*")
            plugin = init_precision(self)
        if type(plugin) is MixedPrecision and plugin.device != "npu":
            return MixedPrecision(plugin.precision, "npu")
        return plugin

    cls._choose_auto_accelerator = staticmethod(_choose_auto_accelerator)
    cls._choose_strategy = _choose_strategy
    cls._check_and_init_precision = _check_and_init_precision
    setattr(cls, _MARK, True)
    return True
