"""Averaging plain tensors over the ranks of a process group, in place (gradients FSDP does not reduce).

A leaf module: it imports nothing from ``lightning_mm``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["average_in_place"]


def average_in_place(tensors: Iterable[torch.Tensor], group: Any = None) -> None:
    """Replace each tensor by its mean over the ranks of ``group`` (all ranks by default): one all-reduce per dtype
    and device. Nothing happens outside a process group."""
    if not dist.is_initialized():
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    world = dist.get_world_size(group)
    for same in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
