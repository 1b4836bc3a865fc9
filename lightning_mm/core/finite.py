"""Stopping on a non-finite loss or gradient norm, on every rank at the same step (free of Lightning).

A NaN or infinite loss on one rank becomes NaN gradients on every rank once they are reduced, and an optimizer step
with them makes every weight NaN; a run that goes on trains nothing and may still exit 0. So, before each
optimizer step, each rank sets its own slot of a per-rank flag vector when a loss it backpropagated since the last
step was not finite; the vector is summed over all ranks inside the reduction that computes the global gradient
norm (:func:`lightning_mm.core.grad_clip.total_grad_norm`, ``also_reduce``), so no extra collective is needed when
the norm is reduced over all ranks at once. Every rank then sees the same flags and the same norm, and all of them
raise the same :class:`NonFiniteError` before the step, or none does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_mm.errors import LightningMMError

__all__ = ["NonFiniteError", "nonfinite", "rank_flags", "check_step"]


class NonFiniteError(LightningMMError, RuntimeError):
    """A NaN or infinite loss or gradient norm; raised on every rank at the same step, before the optimizer step."""


def nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """A bool tensor: whether ``loss`` holds a NaN or an infinity (no host synchronisation)."""
    return ~torch.isfinite(loss.detach()).all()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_flags(bad_loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A float vector with one slot per rank: this rank's slot is 1 when ``bad_loss`` is true, every other 0.

    Summed (or maxed) over all ranks, slot ``r`` tells whether rank ``r`` saw a non-finite loss.
    """
    rank, world = _world()
    flags = torch.zeros(world, device=device)
    if bad_loss is not None:
        flags[rank] = bad_loss.to(device=device, dtype=flags.dtype)
    return flags


def _ranks(ranks: Sequence[int], world: int) -> str:
    if world == 1:
        return ""
    shown = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return f" on rank{'s' if len(ranks) > 1 else ''} {shown} (of {world})"


def check_step(flags: torch.Tensor, norm: torch.Tensor, step: int | None, opt_out: str) -> None:
    """Raise :class:`NonFiniteError` when a rank's flag is set (reduced ``flags``) or ``norm`` is not finite.

    Every rank calls this with the same reduced values, so every rank raises, or none. ``step`` is the number of
    optimizer steps applied so far (Lightning's ``global_step``), ``opt_out`` how to train on instead.
    """
    values = flags.tolist()  # the one host synchronisation of the check
    bad = [rank for rank, value in enumerate(values) if value]
    norm_value = float(norm)
    if not bad and math.isfinite(norm_value):
        return
    at = f" at step {step}" if step is not None else ""
    if bad:
        what = f"non-finite loss{at}{_ranks(bad, len(values))}"
        if not math.isfinite(norm_value):
            what += f", gradient norm {norm_value}"
    else:
        what = f"non-finite gradient norm ({norm_value}){at}, the loss being finite on every rank"
    kept = f" (the weights stay as after {step} optimizer step(s))" if step is not None else ""
    raise NonFiniteError(
        f"{what}: training stopped on every rank before the optimizer step applied it{kept}; "
        f"{opt_out} trains on instead"
    )
