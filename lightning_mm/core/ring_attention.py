"""KV all-gather context parallelism (MindSpeed MM's ``megatron_cp_algo``, ring attention), load-balanced for causal
masks: the layout of the tokens over the ranks and the attention.

Layout (Megatron's and MindSpeed MM's load balancing, ``mindspeed_mm/fsdp/distributed/context_parallel/
communication.py``: ``load_balanced_split_forward_gather_backward``): the sequence, padded at its end to a multiple
of ``2 C``, is cut into ``2 C`` equal chunks; rank ``r`` of the group holds chunks ``r`` and ``2 C - 1 - r`` (the
"zig-zag"). Under a causal mask a query at position ``p`` attends to ``p + 1`` keys, so chunk ``r`` is cheap and
chunk ``2 C - 1 - r`` dear in the same measure: every rank holds the same number of tokens and of (query, key)
pairs.

Attention: each rank keeps the queries of its chunks and all-gathers the keys and values of the whole sequence over
the group (:func:`zigzag_gather`, whose backward sums the group's gradients of the whole sequence and keeps the
rank's chunks: a reduce-scatter of ``dK`` / ``dV``), then attends with a mask built from the global positions of
its queries. Any head count works (no head is scattered, unlike Ulysses), and the group size is not capped by the
heads, so sequences of ``C`` times what one rank holds train for any ``C`` dividing the world size. Llama 3 was
trained this way (keys and values are small next to the queries with grouped-query attention); a ring that passes
key/value blocks between neighbours with an online-softmax merge computes the same numbers with less memory for
the gathered keys and values.

Lightning-free; gloo (CPU), NCCL and HCCL all run these collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mm.core.context_parallel import gather_sequence

__all__ = [
    "kv_allgather_attention",
    "zigzag_causal_sdpa",
    "zigzag_causal_mask",
    "zigzag_gather",
    "zigzag_index",
    "zigzag_padded_length",
    "zigzag_split",
]


def zigzag_padded_length(seq_len: int, size: int) -> int:
    """``seq_len`` rounded up to a multiple of ``2 x size`` (the ``2 C`` chunks of the layout)."""
    return -(-seq_len // (2 * size)) * 2 * size


def zigzag_index(padded: int, size: int, rank: int, device: torch.device | str | None = None) -> Tensor:
    """The global positions rank ``rank`` of ``size`` holds of a ``padded``-token sequence, in its own order:
    chunk ``rank``, then chunk ``2 size - 1 - rank`` of the ``2 size`` equal chunks."""
    if padded % (2 * size):
        raise ValueError(f"a sequence of {padded} tokens does not split into {2 * size} equal chunks")
    chunk = padded // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


def _rank_order(padded: int, size: int, device: torch.device | str | None = None) -> Tensor:
    """The global positions of the ranks' tokens concatenated in rank order (what an all-gather returns)."""
    return torch.cat([zigzag_index(padded, size, r, device) for r in range(size)])


def zigzag_split(t: Tensor, dim: int, group: Any, pad_value: float | int = 0) -> Tensor:
    """This rank's tokens of ``t`` along ``dim`` (padded at the end to a multiple of ``2 C`` with ``pad_value``):
    chunks ``r`` and ``2 C - 1 - r``, a copy (differentiable: the gradient goes back to those positions)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    length = t.shape[dim]
    padded = zigzag_padded_length(length, size)
    if padded != length:
        shape = list(t.shape)
        shape[dim] = padded - length
        t = torch.cat([t, t.new_full(shape, pad_value)], dim=dim)
    return t.index_select(dim, zigzag_index(padded, size, rank, t.device))


def zigzag_gather(t: Tensor, dim: int, group: Any) -> Tensor:
    """The whole (padded) sequence in natural order from every rank's zig-zag tokens along ``dim`` (the inverse of
    :func:`zigzag_split`); differentiable: the backward sums the group's gradients of the whole sequence and keeps
    this rank's tokens (a reduce-scatter)."""
    size = dist.get_world_size(group)
    gathered = gather_sequence(t.contiguous(), dim, group)  # rank order
    order = _rank_order(gathered.shape[dim], size, t.device)
    return gathered.index_select(dim, torch.argsort(order))


def zigzag_causal_mask(
    query_positions: Tensor,
    padded: int,
    causal: bool = True,
    key_valid: Tensor | None = None,
    segments: Tensor | None = None,
) -> Tensor:
    """Which keys of the whole ``padded`` sequence each of this rank's queries may see: a boolean ``(B or 1, 1,
    local, padded)`` mask. ``query_positions``: the queries' global positions (:func:`zigzag_index`); ``key_valid``
    ``(B, padded)``: keys that are real tokens; ``segments`` ``(B, padded)``: the sample of every token of a packed
    row (a query sees only its own sample's keys: block-diagonal)."""
    keys = torch.arange(padded, device=query_positions.device)
    allowed = torch.ones(query_positions.shape[0], padded, dtype=torch.bool, device=keys.device)
    if causal:
        allowed = keys[None, :] <= query_positions[:, None]
    allowed = allowed[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :].to(keys.device)
    if segments is not None:
        segments = segments.to(keys.device)
        own = segments.index_select(1, query_positions)  # (B, local)
        allowed = allowed & (own[:, None, :, None] == segments[:, None, None, :])
    return allowed


def zigzag_causal_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rank: int,
    size: int,
    scale: float | None = None,
    dropout: float = 0.0,
    masks: dict[Any, Tensor] | None = None,
) -> Tensor:
    """Causal attention of this rank's two zig-zag query chunks over the whole sequence's keys/values, without a
    dense mask: chunk ``c`` (positions ``[c L, (c + 1) L)``) sees exactly the keys ``[0, (c + 1) L)`` under a
    lower-right causal mask (``torch.nn.attention.bias.causal_lower_right``, which sdpa's fused kernels take without
    materialising it on CUDA), so each rank computes ``(2 C + 1) L^2`` scores, the same on every rank.

    ``query`` ``(B, H, 2 L, D)`` (this rank's chunks, in its order), ``key``/``value`` ``(B, H_kv, 2 C L, D)`` (natural
    order; grouped-query heads are repeated); returns ``(B, H, 2 L, D)``. Only for causal attention with no padding
    but the end padding (real queries never see the padded keys that follow them) and no packed row.

    On devices other than CUDA sdpa would materialise the lower-right bias in every call (and keep it for backward,
    per layer): there the two boolean masks are built once and kept in ``masks`` (a dict the caller holds for one
    forward), so that every layer shares them."""
    from torch.nn.attention.bias import causal_lower_right

    local = query.shape[2] // 2
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    outs = []
    for i, chunk in enumerate((rank, 2 * size - 1 - rank)):
        end = (chunk + 1) * local
        q = query[:, :, i * local : (i + 1) * local]
        bias: Any = causal_lower_right(local, end)
        if query.device.type != "cuda":
            cache_key = ("lower_right", local, end, query.dtype, query.device)
            if masks is None or cache_key not in (masks or {}):
                allowed = torch.ones(local, end, dtype=torch.bool, device=query.device).tril(end - local)
                zero = torch.zeros((), dtype=query.dtype, device=query.device)
                dense = torch.where(allowed, zero, float("-inf"))  # additive: sdpa keeps it as given
                if masks is None:
                    masks = {}
                masks[cache_key] = dense
            bias = masks[cache_key]
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q, key[:, :, :end], value[:, :, :end], attn_mask=bias, dropout_p=dropout, scale=scale
            )
        )
    return torch.cat(outs, dim=2)


def kv_allgather_attention(
    attention: Callable[..., Tensor],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: Any,
    seq_dim: int = 2,
    **kwargs: Any,
) -> Tensor:
    """Run ``attention(query, key_all, value_all, **kwargs)`` with this rank's queries and the keys/values of the whole
    sequence gathered over ``group`` (natural order). ``query``/``key``/``value`` hold this rank's zig-zag tokens
    (default layout ``(batch, heads, seq, head_dim)``); the result is this rank's tokens. The mask in ``kwargs`` must
    be for (this rank's queries, the whole padded sequence of keys): :func:`zigzag_causal_mask`."""
    if dist.get_world_size(group) == 1:
        return attention(query, key, value, **kwargs)
    kv = zigzag_gather(torch.stack([key, value]), seq_dim + 1, group)  # one collective for both
    return attention(query, kv[0], kv[1], **kwargs)
