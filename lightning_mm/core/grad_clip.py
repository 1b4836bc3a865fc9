"""Gradient-norm clipping that is correct for FSDP2's DTensor gradients, plain gradients, and HSDP meshes.

``torch.nn.utils.clip_grad_norm_`` refuses a mix of DTensors and plain tensors (ignored modules) and of DTensors
on different meshes. Here each gradient contributes its local ``sum |g|^p`` (or max), reduced only over the mesh
dimensions along which it is sharded, so replicated copies are counted once. Parameters whose values differ
between ranks in a way no placement shows (the local experts of an expert-parallel group: each rank holds other
experts) name the extra process groups their terms are summed over (``sum_over``).

torch's public ``get_total_norm`` / ``clip_grads_with_norm_`` were measured against this module on 2 gloo ranks
(``tests/scenarios/clip_scenarios.py``, figures in benchmarks/README.md): both refuse the same mixed lists, so the
grouping by mesh would stay here anyway; per group they are not exact (fp32 norms up to 5e-7 relative off, bf16
gradients up to 2e-3, as each per-tensor norm is rounded to the gradient's dtype), so this module keeps its own
arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_mm._compat import shards_along

__all__ = ["clip_grad_norm_", "clip_grads_with_norm_", "total_grad_norm"]


def _local_term(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    local = grad.detach().float()
    if local.numel() == 0:
        return torch.zeros((), device=local.device)
    if math.isinf(norm_type):
        return local.abs().max()
    return local.abs().pow(norm_type).sum()


def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    sum_over: Mapping[int, Sequence[Any]] | None = None,
    also_reduce: torch.Tensor | None = None,
) -> torch.Tensor:
    """The global gradient norm over all ranks, as a plain scalar tensor (identical on every rank).

    ``sum_over`` maps ``id(parameter)`` to further process groups its term is reduced over, beyond the mesh
    dimensions its placements shard it along (e.g. the ``ep`` group for a local expert).

    ``also_reduce``: a float tensor reduced in place over all ranks along with the norm (summed, or maxed for the
    inf norm), e.g. per-rank flags (:mod:`lightning_mm.core.finite`). It rides in the norm's own all-reduce when
    the terms of one group of parameters are reduced over all ranks at once (one process group spanning the
    world, as with plain FSDP sharding), and takes one all-reduce of its own otherwise.
    """
    sum_over = sum_over or {}
    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    pending = also_reduce if also_reduce is not None and _distributed() else None
    # Group terms by the process groups they must be reduced over.
    terms: dict[tuple, list[torch.Tensor]] = {}
    groups: dict[tuple, list] = {}
    device = None
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        extra = tuple(sum_over.get(id(param), ()))
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            dims = tuple(i for i, p in enumerate(grad.placements) if shards_along(p))
            key: tuple = (id(mesh), dims, *map(id, extra))
            groups.setdefault(key, [*(mesh.get_group(i) for i in dims), *extra])
            term = _local_term(grad.to_local(), norm_type)
        else:
            key = (None, (), *map(id, extra))
            groups.setdefault(key, list(extra))
            term = _local_term(grad, norm_type)
        device = term.device
        terms.setdefault(key, []).append(term)
    total = torch.zeros((), device=device) if device is not None else torch.zeros(())
    for key, values in terms.items():
        value = torch.stack([v.to(device) for v in values])
        value = value.max() if is_inf else value.sum()
        if pending is not None and len(groups[key]) == 1 and _spans_world(groups[key][0]):
            packed = torch.cat([value.reshape(1), pending.detach().to(value.device, torch.float32).reshape(-1)])
            dist.all_reduce(packed, op=op, group=groups[key][0])
            value = packed[0]
            pending.copy_(packed[1:].reshape(pending.shape))
            pending = None
        else:
            for group in groups[key]:
                dist.all_reduce(value, op=op, group=group)
        total = torch.maximum(total, value) if is_inf else total + value
    if pending is not None:  # no group of terms spans every rank: the tensor on its own
        buffer = pending.to(device) if device is not None else pending
        dist.all_reduce(buffer, op=op)
        if buffer is not pending:
            pending.copy_(buffer)
    if device is None:
        return total
    return total if is_inf else total.pow(1.0 / norm_type)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _spans_world(group: Any) -> bool:
    return dist.get_world_size(group) == dist.get_world_size()


def clip_grads_with_norm_(parameters: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place so that a global norm of ``total_norm`` becomes at most ``max_norm``.

    The counterpart of ``torch.nn.utils.clip_grads_with_norm_`` for gradients on several meshes or none: the norm
    comes from :func:`total_grad_norm` (computed once, e.g. shared with the logged ``train/grad_norm``).
    """
    coef = max_norm / (float(total_norm) + 1e-6)
    if coef < 1.0:
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(coef)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    sum_over: Mapping[int, Sequence[Any]] | None = None,
) -> torch.Tensor:
    """Scale gradients in place so that their global norm is at most ``max_norm``; returns the norm before."""
    parameters = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(parameters, norm_type, sum_over)
    clip_grads_with_norm_(parameters, max_norm, total)
    return total
