"""Accelerators (the Ascend NPU accelerator lives here; torch_npu is never imported at package import)."""

from lightning_mm.accelerators.npu import NPUAccelerator, NPUUnavailableError

__all__ = ["NPUAccelerator", "NPUUnavailableError"]
