"""Device-agnostic runtime helpers: synchronisation and memory statistics for a device of any type.

Everything is keyed on the device (``cpu``, ``cuda``, ``npu``, ``xpu``...), never on CUDA. Synchronisation goes
through ``torch.accelerator`` when the device is the current accelerator. Memory statistics go through the
backend's device module (``torch.cuda``, ``torch.npu``...): it is the memory API that CUDA, torch_npu and XPU all
implement, whereas ``torch.accelerator``'s memory functions need the backend's allocator to be registered with
PyTorch core, which an out-of-tree backend may not do. CPU has no device statistics: empty results, no-ops.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

__all__ = [
    "device_module",
    "is_current_accelerator",
    "synchronize",
    "memory_stats",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "empty_cache",
]


def _device(device: torch.device | str) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def device_module(device: torch.device | str) -> ModuleType:
    """The ``torch.<type>`` module of ``device`` (``torch.npu`` once torch_npu is imported)."""
    return torch.get_device_module(_device(device))


def is_current_accelerator(device: torch.device | str) -> bool:
    """Whether ``device`` is of the type ``torch.accelerator`` reports for this process."""
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type == _device(device).type


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU)."""
    device = _device(device)
    if device.type == "cpu":
        return
    if is_current_accelerator(device):
        torch.accelerator.synchronize(device)
    else:
        device_module(device).synchronize(device)


def memory_stats(device: torch.device | str) -> dict[str, Any]:
    """The allocator statistics of ``device`` (``{}`` on CPU)."""
    device = _device(device)
    if device.type == "cpu":
        return {}
    return dict(device_module(device).memory_stats(device))


def max_memory_allocated(device: torch.device | str) -> int | None:
    """Peak bytes allocated by tensors on ``device`` since the last reset (``None`` on CPU)."""
    device = _device(device)
    if device.type == "cpu":
        return None
    return int(device_module(device).max_memory_allocated(device))


def reset_peak_memory_stats(device: torch.device | str) -> None:
    """Start a new peak-memory window on ``device`` (a no-op on CPU)."""
    device = _device(device)
    if device.type != "cpu":
        device_module(device).reset_peak_memory_stats(device)


def empty_cache(device: torch.device | str) -> None:
    """Release the cached, unused memory of ``device``'s allocator (a no-op on CPU)."""
    device = _device(device)
    if device.type != "cpu":
        device_module(device).empty_cache()
