"""Accelerators (the Ascend NPU accelerator and its single-device strategy; torch_npu is never imported at package
import)."""

from lightning_mm.accelerators.npu import NPUAccelerator, NPUUnavailableError
from lightning_mm.accelerators.single_npu import SingleNPUStrategy

__all__ = ["NPUAccelerator", "NPUUnavailableError", "SingleNPUStrategy"]
