"""Ulysses context parallelism over the video tokens of a diffusers ``WanTransformer3DModel``.

:func:`enable_wan_context_parallel` prepares the model for a context-parallel group of ``C`` ranks (which train on
the same samples):

* the input of the first block (the patch-embedded video tokens) and the rotary tables keep this rank's
  ``S / C`` tokens (:func:`~lightning_mm.core.context_parallel.split_sequence`); the number of video tokens
  ``F/p_t * H/p_h * W/p_w`` must divide by ``C``;
* the self-attention of each block (``attn1``) runs through :class:`UlyssesWanSelfAttention`, a diffusers
  attention processor: projections, query/key norms and rotary embedding on the local tokens, an all-to-all to
  (all tokens, ``heads / C``), attention, and the inverse all-to-all. The cross-attention to the text needs no
  communication (each token attends to the whole prompt);
* the output of the last block is gathered back to all ``S`` tokens; the output norm and projection run on every
  rank, so every rank of the group computes the loss of the whole sample. The gather's backward hands each rank
  ``C`` times the gradient of its own tokens, which FSDP's average over ``D x C`` ranks turns back into the
  data-parallel average (as :func:`~lightning_mm.core.context_parallel.context_parallel_loss` does for LMs).

The numbers equal training without context parallelism. The patch and condition embeddings run on whole inputs.
Wan 2.1 i2v (image keys in ``attn2``) is supported (only ``attn1`` is routed); per-token timesteps (Wan 2.2 ti2v)
are not.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mm.core.context_parallel import ContextParallelError, all_to_all, check_heads, split_sequence

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_wan import WanAttention

__all__ = ["UlyssesWanSelfAttention", "enable_wan_context_parallel"]

#: The models routed through Ulysses, and the handles of their hooks: kept here, not written on the user's model
#: (a second :func:`enable_wan_context_parallel` of the same model does nothing); weak: it dies with the model.
_ENABLED: weakref.WeakKeyDictionary[nn.Module, list[RemovableHandle]] = weakref.WeakKeyDictionary()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on interleaved pairs ``(x[2i], x[2i+1])`` with the tables' angle of pair ``i``."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)


class UlyssesWanSelfAttention:
    """A diffusers attention processor for a Wan block's self-attention over a context-parallel group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ContextParallelError("UlyssesWanSelfAttention serves self-attention without a mask only")
        if getattr(attn, "fused_projections", False):
            raise ContextParallelError(
                "UlyssesWanSelfAttention: fused projections (fuse_projections()) are not "
                "supported under context parallelism"
            )
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        # (B, S/C, H, D) -> (B, S, H/C, D): all tokens, this rank's heads
        q, k, v = (all_to_all(t, 2, 1, self.group).transpose(1, 2) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = all_to_all(out.transpose(1, 2), 1, 2, self.group)  # back to (B, S/C, H, D)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class _GatherTokens(torch.autograd.Function):
    """All-gather along the token dimension; backward: ``C`` times this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=1)[rank] * size, None


def enable_wan_context_parallel(predictor: nn.Module, group: Any) -> None:
    """Route ``predictor`` (a ``WanTransformer3DModel``) through Ulysses over ``group`` (see the module docstring)."""
    size = dist.get_world_size(group)
    # Read by attribute (config.num_attention_heads, rope, blocks' attn1): diffusers types `config` as a dict and
    # set_processor's argument as its own processors' union, so the WanTransformer3DModel is not typed as one here.
    wan: Any = predictor
    blocks = getattr(predictor, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        raise ContextParallelError(f"{type(predictor).__name__} has no `blocks` to run context-parallel")
    check_heads(int(wan.config.num_attention_heads), None, size, type(predictor).__name__)
    if predictor in _ENABLED:
        return

    def split_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0]
        if hidden.shape[1] % size:
            raise ContextParallelError(
                f"context_parallel_size {size}: {hidden.shape[1]} video tokens (frames x height x width after the "
                f"patches) do not divide by {size}; choose latent sizes whose token count does"
            )
        return (split_sequence(hidden, 1, group), *args[1:]), kwargs

    def split_rotary(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        cos, sin = output  # (1, S, 1, D) tables
        return split_sequence(cos, 1, group), split_sequence(sin, 1, group)

    def gather_output(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return _GatherTokens.apply(output, group)

    handles = [
        blocks[0].register_forward_pre_hook(split_inputs, with_kwargs=True),
        wan.rope.register_forward_hook(split_rotary),
        blocks[-1].register_forward_hook(gather_output),
    ]
    for block in blocks:
        wan_block: Any = block
        wan_block.attn1.set_processor(UlyssesWanSelfAttention(group))
    _ENABLED[predictor] = handles
