"""Process-group backend for a device type: the strategy never hard-codes one accelerator."""

from __future__ import annotations

import torch

__all__ = ["process_group_backend"]

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}


def process_group_backend(device: torch.device | str, offload_to_cpu: bool = False) -> str:
    """``gloo`` on CPU, ``nccl`` on CUDA, ``hccl`` on NPU; with CPU offload a mixed ``<dev>:<backend>,cpu:gloo``."""
    device_type = torch.device(device).type
    if device_type not in _BACKENDS:
        raise ValueError(
            f"no known process-group backend for device type '{device_type}'; pass `process_group_backend=` "
            "to MMFSDP2Strategy"
        )
    backend = _BACKENDS[device_type]
    if offload_to_cpu and device_type != "cpu":
        return f"{device_type}:{backend},cpu:gloo"
    return backend
