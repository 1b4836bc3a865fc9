"""Accelerators (the Ascend NPU accelerator lives here; torch_npu is never imported at package import)."""
