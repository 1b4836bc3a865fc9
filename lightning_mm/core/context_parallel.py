"""Ulysses context parallelism (DeepSpeed-Ulysses, MindSpeed MM's ``ulysses_cp_algo``): deciding and doing.

The plan covers both algorithms of ``context_parallel_algo``; the KV all-gather one (MindSpeed MM's
``megatron_cp_algo``: zig-zag chunks, keys and values gathered) is in :mod:`lightning_mm.core.ring_attention`.

``C = context_parallel_size`` consecutive ranks form a context-parallel group: they work on the same samples, each
holding ``ceil(S / C)`` tokens of every sequence (the sequence is padded at its end to a multiple of ``C``; padded
positions are masked out of attention and of the loss). Inside attention an all-to-all gathers the whole sequence
and scatters the heads (each rank attends over all tokens with ``H / C`` heads); a second all-to-all restores the
sequence split. Parameters stay FSDP-sharded over all ranks (data parallel x context parallel, as torchtitan
does); the data sampler runs over the ``world / C`` data-parallel groups.

Loss: each rank sums the token losses of its slice and divides by the number of target tokens of the whole
sequences (summed over the group); a differentiable all-reduce over the group then gives every rank the loss of
the whole sequences, and its backward multiplies each rank's gradients by ``C``, which FSDP's average over
``world = D x C`` ranks turns back into the data-parallel average. The numbers equal training without context
parallelism.

:class:`ContextParallelPlan` is pure data (printable, no processes). The functions below it act with
torch.distributed; all collectives are supported by gloo (CPU) as well as NCCL/HCCL.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mm.core.cp_algorithms import ALGORITHM_NAMES, ALGORITHMS, ContextParallelError, canonical_algorithm

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "canonical_algorithm",
    "ContextParallelError",
    "ContextParallelPlan",
    "activation_bytes_estimate",
    "all_to_all",
    "build_context_parallel_mesh",
    "check_heads",
    "context_parallel_loss",
    "context_parallel_plan",
    "gather_sequence",
    "shift_labels",
    "split_sequence",
    "ulysses_attention",
]

IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------------- deciding
@dataclass(frozen=True)
class ContextParallelPlan:
    """The context-parallel layout: which ranks share samples, and what each rank holds."""

    world_size: int
    size: int
    algo: str = "ulysses"
    """``ulysses`` (heads scattered) or ``kv_allgather`` (keys/values gathered, zig-zag chunks)."""
    tp: int = 1
    """``tensor_parallel_size``: the ``tp`` consecutive ranks innermost; a context-parallel group takes every
    ``tp``-th rank (ranks ``r`` with the same ``r // (C tp)`` and ``r % tp``)."""

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.size * self.tp)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.data_parallel_size, self.size)

    @property
    def mesh_dim_names(self) -> tuple[str, str]:
        return ("dp", "cp")

    def groups(self) -> list[list[int]]:
        """The context-parallel groups: ``C`` consecutive ranks each (every ``tp``-th rank with tensor
        parallelism)."""
        block = self.size * self.tp
        return [
            [d * block + c * self.tp + t for c in range(self.size)]
            for d in range(self.data_parallel_size)
            for t in range(self.tp)
        ]

    def data_parallel_rank(self, rank: int) -> int:
        return rank // (self.size * self.tp)

    @property
    def multiple(self) -> int:
        """Sequences are padded to a multiple of this: ``C`` (Ulysses) or ``2 C`` (the zig-zag chunks)."""
        return self.size * (2 if self.algo == "kv_allgather" else 1)

    def padded_length(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.multiple) * self.multiple

    def local_length(self, seq_len: int) -> int:
        return self.padded_length(seq_len) // self.size

    def heads_per_rank(self, num_heads: int) -> int:
        return num_heads // self.size

    def describe(self, seq_len: int | None = None, activation_bytes: int | None = None) -> str:
        """The mesh with its ``cp`` dimension; with ``seq_len`` the tokens and activation memory per rank."""
        if not self.enabled:
            line = "context parallel: off (context_parallel_size 1)"
            if seq_len is not None and activation_bytes is not None:
                line += f"; decoder activations per rank for {seq_len} tokens ~ {_mib(activation_bytes)}"
            return line
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        groups = ", ".join("[" + ",".join(map(str, g)) + "]" for g in self.groups()[:4])
        more = " ..." if len(self.groups()) > 4 else ""
        lines = [
            f"context parallel: {self.algo}, mesh ({mesh}); groups sharing samples: {groups}{more}",
            f"  FSDP shards parameters over dp x cp = {self.world_size} ranks; the sampler runs over "
            f"{self.data_parallel_size} data-parallel rank(s)",
        ]
        if self.tp > 1:
            lines[0] = (
                f"context parallel: {self.algo}, mesh ({mesh}) (each group ranks {self.tp} apart); "
                f"groups: {groups}{more}"
            )
            lines[1] = (
                f"  FSDP shards parameters over dp x cp = {self.world_size // self.tp} ranks (tensor_parallel_size "
                f"{self.tp} inside); the sampler runs over {self.data_parallel_size} data-parallel rank(s)"
            )
        if self.algo == "kv_allgather":
            c = self.size
            lines.append(
                f"  attention: KV all-gather (MindSpeed MM's megatron_cp_algo): the sequence is cut into {2 * c} "
                f"chunks, rank r holds chunks r and {2 * c - 1}-r (causal load balance); each rank keeps its queries "
                "and all-gathers keys/values (backward: reduce-scatter); any head count; lengths not divisible by "
                f"{2 * c} are padded at the end and masked"
            )
        else:
            lines.append(
                "  attention: all-to-all to (whole sequence, heads / C), attend, all-to-all back; lengths not "
                f"divisible by {self.size} are padded at the end and masked"
            )
        if seq_len is not None:
            local = self.local_length(seq_len)
            pad = self.padded_length(seq_len) - seq_len
            lines.append(f"  sequence {seq_len} tokens -> {local} per rank" + (f" ({pad} padding)" if pad else ""))
            if activation_bytes is not None:
                per_rank = activation_bytes * local / seq_len
                lines.append(
                    f"  decoder activations per rank ~ {_mib(per_rank)} (without context parallel "
                    f"{_mib(activation_bytes)}; 1/{self.size})"
                )
        return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def activation_bytes_estimate(
    hidden_size: int, num_layers: int, seq_len: int, batch: int = 1, bytes_per_value: int = 2
) -> int:
    """Activations a decoder keeps for backward, without recomputation: about ``34 x seq x batch x hidden`` 16-bit
    bytes per layer (Korthikanti et al., 2022, with attention scores not stored, as sdpa/flash attention do).
    An estimate for planning; context parallelism divides it by ``C``."""
    return int(34 * seq_len * batch * hidden_size * num_layers * bytes_per_value / 2)


def context_parallel_plan(world_size: int, size: int, algo: str = "ulysses", tp: int = 1) -> ContextParallelPlan:
    """Check ``size`` and ``algo`` against ``world_size``; every problem is a :class:`ContextParallelError`."""
    if not isinstance(size, int) or size < 1:
        raise ContextParallelError(f"context_parallel_size must be a positive integer, got {size!r}")
    algo = canonical_algorithm(algo)
    if world_size % size:
        raise ContextParallelError(
            f"context_parallel_size {size} does not divide the world size {world_size}: each context-parallel "
            f"group needs {size} ranks"
        )
    if world_size % (size * tp):
        raise ContextParallelError(
            f"context_parallel_size {size} x tensor_parallel_size {tp} does not divide the world size {world_size}"
        )
    return ContextParallelPlan(world_size, size, algo, tp)


def check_heads(num_heads: int, num_kv_heads: int | None, size: int, where: str) -> None:
    """Ulysses gives each rank ``heads / C`` attention heads: both head counts must divide by ``C``."""
    for label, n in (("attention heads", num_heads), ("key/value heads", num_kv_heads or num_heads)):
        if n % size:
            raise ContextParallelError(
                f"{where}: {n} {label} do not divide by context_parallel_size {size} (Ulysses scatters the heads "
                f"over the {size} ranks of a context-parallel group); choose a size dividing {num_heads} and "
                f"{num_kv_heads or num_heads}"
            )


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``labels`` shifted one to the left (the target of token ``i`` is ``labels[i + 1]``), ``ignore_index`` last."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


# ---------------------------------------------------------------------------------------------------- doing
def build_context_parallel_mesh(plan: ContextParallelPlan, device_type: str) -> Any:
    """The ``(dp, cp)`` device mesh of ``plan`` (an explicit mesh on ``device_type``, CPU included)."""
    from lightning_mm.core.parallel_layout import device_mesh

    return device_mesh(device_type, plan.mesh_shape, plan.mesh_dim_names)


def _rank_size(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def split_sequence(t: Tensor, dim: int, group: Any, pad_value: float | int = 0) -> Tensor:
    """This rank's slice of ``t`` along ``dim``: padded at the end to a multiple of the group size, then cut
    into equal contiguous slices (rank ``r`` of the group takes slice ``r``)."""
    rank, size = _rank_size(group)
    length = t.shape[dim]
    padded = math.ceil(length / size) * size
    if padded != length:
        shape = list(t.shape)
        shape[dim] = padded - length
        t = torch.cat([t, t.new_full(shape, pad_value)], dim=dim)
    # A copy, not a view: a view would keep the whole-sequence tensor (e.g. the embeddings) alive until backward.
    return t.narrow(dim, rank * (padded // size), padded // size).clone()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scatter_dim: int, gather_dim: int, group: Any) -> Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: Any) -> Tensor:
    size = dist.get_world_size(group)
    chunks = torch.stack(torch.tensor_split(x, size, dim=scatter_dim)).contiguous()
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: Any) -> Tensor:
    """Split ``x`` along ``scatter_dim`` over the group's ranks and concatenate what they send along
    ``gather_dim`` (in rank order); differentiable (its backward is the inverse all-to-all)."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Any) -> Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # Reduce-scatter (as an all-reduce and this rank's slice: gloo has no reduce-scatter): each rank's
        # gradient of the whole sequence holds what its own outputs contribute; their sum is the input's gradient.
        rank, size = _rank_size(ctx.group)
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        local = grad.shape[ctx.dim] // size
        return grad.narrow(ctx.dim, rank * local, local).contiguous(), None, None


def gather_sequence(x: Tensor, dim: int, group: Any) -> Tensor:
    """The whole (padded) sequence from every rank's slice of it along ``dim`` (the inverse of
    :func:`split_sequence`, in rank order); differentiable: the backward sums the group's gradients of the whole
    sequence and keeps this rank's slice (a reduce-scatter)."""
    if dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, dim, group)


def ulysses_attention(
    attention: Callable[..., Tensor],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: Any,
    head_dim: int = 1,
    seq_dim: int = 2,
    **kwargs: Any,
) -> Tensor:
    """Run ``attention(query, key, value, **kwargs)`` over whole sequences with ``heads / C`` heads per rank.

    ``query``/``key``/``value`` hold this rank's sequence slice with all heads (default layout ``(batch, heads,
    seq, head_dim)``, as ``scaled_dot_product_attention`` takes it). ``attention`` sees the whole sequence with
    the rank's share of the heads and must return the same layout; the result comes back as this rank's slice
    with all heads. Masks passed in ``kwargs`` must be for the whole (padded) sequence.
    """
    q, k, v = (all_to_all(t, head_dim, seq_dim, group) for t in (query, key, value))
    out = attention(q, k, v, **kwargs)
    return all_to_all(out, seq_dim, head_dim, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def context_parallel_loss(logits: Tensor, targets: Tensor, group: Any, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The token-level cross entropy of whole sequences from this rank's slice.

    ``logits`` ``(..., local_seq, vocab)`` and ``targets`` (already shifted, see :func:`shift_labels`, then
    split with :func:`split_sequence`) are this rank's slice. The sum of the slice's token losses is divided by
    the number of targets in the whole sequences, then summed over the group (differentiably): every rank gets
    the loss of the whole sequences, equal to training without context parallelism.
    """
    flat = logits.float().reshape(-1, logits.shape[-1])
    local = torch.nn.functional.cross_entropy(
        flat, targets.reshape(-1).to(flat.device), ignore_index=ignore_index, reduction="sum"
    )
    count = (targets != ignore_index).sum().to(flat.device, torch.float32)
    dist.all_reduce(count, group=group)
    return _AllReduceSum.apply(local / count.clamp_min(1), group)
