"""Process-group backend for a device type: the strategy never hard-codes one accelerator."""

from __future__ import annotations

import torch

from lightning_mm.errors import ConfigError

__all__ = ["process_group_backend"]

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}


def process_group_backend(device: torch.device | str, offload_to_cpu: bool = False) -> str:
    """``gloo`` on CPU, ``nccl`` on CUDA, ``hccl`` on NPU; with CPU offload a mixed ``<dev>:<backend>,cpu:gloo``.

    Other device types take the backend their out-of-tree package registered with
    ``torch.distributed.Backend.register_backend(..., devices=[...])``.
    """
    # A string is read without torch.device(), which rejects "npu" until torch_npu has registered it.
    device_type = device.type if isinstance(device, torch.device) else device.split(":")[0].strip()
    backend = _BACKENDS.get(device_type)
    if backend is None and torch.distributed.is_available():
        backend = torch.distributed.Backend.default_device_backend_map.get(device_type)
    if backend is None:
        raise ConfigError(
            f"no known process-group backend for device type '{device_type}'; pass `process_group_backend=` "
            "to MMFSDP2Strategy"
        )
    if offload_to_cpu and device_type != "cpu":
        return f"{device_type}:{backend},cpu:gloo"
    return backend
