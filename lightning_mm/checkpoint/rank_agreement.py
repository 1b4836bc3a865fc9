"""How the ranks of a checkpoint save or load agree: rank 0's value on every rank, every rank's value on rank 0, a
barrier, and an error raised on every rank at once; each a no-op without a process group of more than one rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_mm.errors import ConfigError

__all__ = [
    "is_distributed",
    "broadcast_from_rank_zero",
    "gather_to_rank_zero",
    "barrier",
    "raise_on_every_rank",
    "raise_first_on_every_rank",
]


def is_distributed() -> bool:
    """Whether a process group of more than one rank is running (the collectives below are no-ops otherwise)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_from_rank_zero(obj: Any, group: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (``obj`` itself without a process group)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0, group=group)
    return box[0]


def gather_to_rank_zero(obj: Any, group: Any = None) -> list[Any] | None:
    """``obj`` of every rank, in rank order, on rank 0 (None elsewhere)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)  # all_gather: supported by every backend (gloo, nccl, hccl)
    return out if dist.get_rank() == 0 else None


def barrier(group: Any = None) -> None:
    """A barrier over ``group`` (nothing without a process group of more than one rank)."""
    if is_distributed():
        dist.barrier(group=group)


def raise_on_every_rank(error: str | None) -> None:
    """Raise on every rank the error rank 0 found (so that no rank waits in a collective for the others)."""
    error = broadcast_from_rank_zero(error)
    if error:
        raise ConfigError(error)


def raise_first_on_every_rank(error: str | None, group: Any = None) -> None:
    """Raise on every rank of ``group`` the error of the first rank that found one (each rank checks its own
    part); one small collective when none did (a flag reduced over a gloo ``group``; objects over the default)."""
    if not is_distributed():
        if error:
            raise ConfigError(error)
        return
    if group is not None:
        flag = torch.tensor([1 if error else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not flag.item():
            return
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), None)
    if first:
        raise ConfigError(first)
