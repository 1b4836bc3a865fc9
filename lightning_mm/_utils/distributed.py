"""Small distributed helpers for the layers below Lightning: averaging plain tensors over a group, a tensor's
local part, and messages given once per job by global rank 0.

A leaf module: it imports nothing from ``lightning_mm``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["average_in_place", "local_tensor", "is_rank_zero", "rank_zero_info", "rank_zero_warn"]


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


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: ``to_local()`` of a ``DTensor``, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


log = logging.getLogger("lightning_mm")


log.setLevel(logging.INFO)


if not logging.getLogger().hasHandlers():  # as Lightning does for its own logger: INFO shows unless the app logs
    log.addHandler(logging.StreamHandler())
    log.propagate = False


def is_rank_zero() -> bool:
    """True outside a process group, and on its global rank 0."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> None:
    """``warnings.warn`` on global rank 0 only (the caller's caller is named as the place)."""
    if is_rank_zero():
        warnings.warn(message, category, stacklevel=stacklevel)


def rank_zero_info(message: str) -> None:
    """An INFO record of the ``lightning_mm`` logger, on global rank 0 only."""
    if is_rank_zero():
        log.info(message)
