"""Chunked linear cross-entropy: the loss of an output layer without its ``[tokens, vocab]`` logits.

A language model's loss is ``cross_entropy(hidden @ weight.T + bias, targets)``; with a 150 K vocabulary the
float32 logits of 8 K tokens take 5 GB, and their gradient as much again. :func:`linear_cross_entropy` computes the
same loss ``chunk_size`` tokens at a time: for each chunk it forms the chunk's logits (in float32, as Transformers'
own loss upcasts them), its log-sum-exp and target logit, and at once the chunk's gradients (the softmax minus the
one-hot target, scaled by the normaliser), which it multiplies into the gradients of the hidden states and of the
weight before the next chunk. No tensor larger than ``chunk_size x vocab`` float32 values exists at any time; the
backward only scales the gradients kept from the forward by the loss's incoming gradient (a scalar), so the output
layer costs the same three matrix products as the unchunked computation (logits, hidden gradient, weight
gradient), not four as a recomputing backward would.

The output layer may be a sum of several linear maps (``logits = sum_i x_i @ w_i.T + bias``): LoRA on the head is
``x @ w0.T + (scale * lora_A(dropout(x))) @ lora_B.T``, so its adapters' gradients flow through ``x_1`` and
``lora_B``. Normalisation is Transformers' (``ForCausalLMLoss``): the sum of the token losses divided by the number
of targets that are not ``ignore_index``, or by ``num_items`` when given.

Weights must be plain tensors: under FSDP2 call this inside the forward of the module that owns the weight, where
it is unsharded (:mod:`lightning_mm.hf.chunk_loss` does so for Transformers models).

Vocabulary-parallel (``group``): under tensor parallelism the output layer is column-parallel, each rank of ``group``
holding the rows ``vocab_start .. vocab_start + local vocab`` of the weight (and bias) and the whole hidden states.
Per chunk each rank forms the logits of its shard; their maximum is all-reduced (MAX), then their sum of
exponentials and the target logit (taken by the rank whose shard holds the target, zero elsewhere) are all-reduced
(SUM, one collective): every rank gets the exact loss of the whole vocabulary. The gradient of the weight (and bias)
is that of the rank's shard; the gradient of the hidden states, a partial sum over the shards, is all-reduced over
``group`` once after the last chunk. No rank forms more than ``chunk_size x local vocab`` logits. This is the
chunked path's own computation rather than torch's ``loss_parallel``: that context manager computes the
cross-entropy of whole DTensor logits (the ``[tokens, vocab / tp]`` tensor this module exists to avoid) and its
gradient through autograd, where this function has its gradients ready in the forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mm.core.context_parallel import shift_labels
from lightning_mm.errors import ConfigError, StateError

__all__ = [
    "IGNORE_INDEX",
    "ChunkedLossError",
    "linear_cross_entropy",
    "shift_labels",
    "check_chunk_size",
    "mark_chunked_head",
    "is_chunked_head",
]

IGNORE_INDEX = -100


class ChunkedLossError(ConfigError):
    """Inputs the chunked loss cannot compute with."""


#: The output layers whose loss is chunked (:func:`mark_chunked_head`): under tensor parallelism the plan splits them
#: by vocabulary (column-parallel) and the chunked loss computes the vocabulary-parallel cross-entropy.
_CHUNKED_HEADS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def mark_chunked_head(head: torch.nn.Module) -> None:
    """Record that ``head``'s loss is chunked (:mod:`lightning_mm.hf.chunk_loss` calls this)."""
    _CHUNKED_HEADS.add(head)


def is_chunked_head(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an output layer whose loss :func:`linear_cross_entropy` computes."""
    return module in _CHUNKED_HEADS


def check_chunk_size(value: Any, key: str = "chunk_loss_size") -> int:
    """``value`` as a chunk size (a positive integer), else an error naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ChunkedLossError(f"`{key}`: expected a positive number of tokens, got {value!r}")
    return value


def linear_cross_entropy(
    hidden: Tensor | Sequence[Tensor],
    weight: Tensor | Sequence[Tensor],
    targets: Tensor,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    num_items: Tensor | float | None = None,
    group: Any = None,
    vocab_start: int = 0,
) -> Tensor:
    """``cross_entropy(sum_i hidden_i @ weight_i.T + bias, targets)``, ``chunk_size`` tokens at a time.

    Args:
        hidden: ``(..., k)`` inputs of the output layer (or one per linear term), the leading dimensions those of
            ``targets``.
        weight: ``(vocab, k)`` weights (or one per term, each matching its ``hidden``).
        targets: class indices, already shifted (:func:`shift_labels`); ``ignore_index`` entries add nothing.
        bias: an optional ``(vocab,)`` bias.
        chunk_size: tokens per chunk.
        ignore_index: the target that marks a token without loss.
        num_items: the normaliser; by default the number of targets that are not ``ignore_index``.
        group: vocabulary-parallel: the process group over which the vocabulary is split (``weight`` and ``bias``
            are this rank's rows of it, ``hidden`` and ``targets`` the same on every rank of the group).
        vocab_start: vocabulary-parallel: the index of this rank's first row of the vocabulary.

    Returns:
        The scalar float32 loss: the sum of the token losses over the normaliser. Its gradients with respect to
        every input that requires one equal those of the unchunked computation.
    """
    hiddens = [hidden] if isinstance(hidden, Tensor) else list(hidden)
    weights = [weight] if isinstance(weight, Tensor) else list(weight)
    chunk_size = check_chunk_size(chunk_size, "chunk_size")
    if not hiddens or len(hiddens) != len(weights):
        raise ChunkedLossError(f"give one weight per hidden input: {len(hiddens)} inputs, {len(weights)} weights")
    vocab = weights[0].shape[0]
    lead = tuple(targets.shape)
    for i, (x, w) in enumerate(zip(hiddens, weights)):
        _check_plain(w, f"weight {i}")
        if w.ndim != 2 or w.shape[0] != vocab or x.shape[-1] != w.shape[1] or tuple(x.shape[:-1]) != lead:
            raise ChunkedLossError(
                f"term {i}: hidden {tuple(x.shape)} and weight {tuple(w.shape)} do not fit targets {lead} "
                f"(need hidden (*targets.shape, k) and weight ({vocab}, k))"
            )
    if bias is not None:
        _check_plain(bias, "bias")
        if tuple(bias.shape) != (vocab,):
            raise ChunkedLossError(f"bias {tuple(bias.shape)} does not fit a vocabulary of {vocab}")
    flat_targets = targets.reshape(-1)
    if num_items is None:
        denominator = (flat_targets != ignore_index).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items, dtype=torch.float32, device=flat_targets.device)
    inputs = [x.reshape(-1, x.shape[-1]) for x in hiddens]
    tensors = [*inputs, *weights, *([bias] if bias is not None else [])]
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and t.requires_grad for t in tensors)
    parallel = (group, vocab_start) if group is not None else None
    return _LinearCrossEntropy.apply(
        flat_targets, denominator, chunk_size, ignore_index, len(inputs), bias is not None, needs, parallel, *tensors
    )


def _check_plain(t: Tensor, what: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise ChunkedLossError(
            f"{what} is a sharded DTensor: compute the chunked loss inside the forward of the FSDP module that owns "
            "it, where FSDP2 has gathered it"
        )


class _LinearCrossEntropy(torch.autograd.Function):
    """The forward computes the loss and, chunk by chunk, the gradients for a unit incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        targets: Tensor,
        denominator: Tensor,
        chunk_size: int,
        ignore_index: int,
        terms: int,
        has_bias: bool,
        needs: tuple[bool, ...],
        parallel: tuple[Any, int] | None,
        *tensors: Tensor,
    ) -> Tensor:
        xs, ws = tensors[:terms], tensors[terms : 2 * terms]
        bias = tensors[2 * terms] if has_bias else None
        need_x, need_w = needs[:terms], needs[terms : 2 * terms]
        need_b = bias is not None and needs[2 * terms]
        any_grad = any(needs)
        acc = torch.promote_types(xs[0].dtype, torch.float32)  # the loss's dtype: float32, or float64 inputs' own
        scale = denominator.to(acc).reciprocal()
        vocab = ws[0].shape[0]
        grad_x = [torch.empty_like(x) if n else None for x, n in zip(xs, need_x)]
        # Weight gradients accumulate over chunks in the weight's dtype (each chunk's product accumulates in
        # float32 inside the kernel): a float32 buffer would add 2 bytes per weight element for 16-bit weights.
        grad_w = [torch.zeros_like(w) if n else None for w, n in zip(ws, need_w)]
        grad_b = torch.zeros(vocab, dtype=acc, device=bias.device) if need_b and bias is not None else None
        total = torch.zeros((), dtype=acc, device=targets.device)
        for start in range(0, targets.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            target = targets[rows]
            valid = target != ignore_index
            owned = valid
            if parallel is not None:  # the targets of this rank's vocabulary shard, as local indices
                target = target - parallel[1]
                owned = valid & (target >= 0) & (target < vocab)
            safe = torch.where(owned, target, 0).unsqueeze(1)
            logits = torch.mm(xs[0][rows], ws[0].t())
            for x, w in zip(xs[1:], ws[1:]):
                logits.addmm_(x[rows], w.t())
            mm_dtype = logits.dtype
            logits = logits.to(acc)  # Transformers' loss upcasts the logits; no copy when they are float32
            if bias is not None:
                logits.add_(bias)
            picked = torch.where(owned, logits.gather(1, safe).squeeze(1), 0)
            peak = logits.amax(dim=1, keepdim=True)
            if parallel is not None:
                dist.all_reduce(peak, dist.ReduceOp.MAX, group=parallel[0])
            logits.sub_(peak).exp_()  # in place: one chunk x vocab buffer throughout
            sums = logits.sum(dim=1)
            if parallel is not None:  # the sum of exponentials and the target logit (from its owner) at once
                reduced = torch.stack([sums, picked])
                dist.all_reduce(reduced, group=parallel[0])
                sums, picked = reduced[0], reduced[1]
            token_loss = peak.squeeze(1) + sums.log() - picked
            total += torch.where(valid, token_loss, 0).sum()
            if not any_grad:
                del logits  # freed before the next chunk's product
                continue
            # d loss / d logits = (softmax - one_hot(target)) * scale on valid rows, 0 elsewhere.
            logits.div_(sums.unsqueeze(1))
            logits.scatter_add_(1, safe, torch.where(owned, -1.0, 0.0).to(logits.dtype).unsqueeze(1))
            logits.mul_((valid.to(logits.dtype) * scale).unsqueeze(1))
            if grad_b is not None:
                grad_b.add_(logits.sum(dim=0))
            grad = logits.to(mm_dtype)  # a 16-bit copy for 16-bit products (the float32 one is freed)
            del logits
            for x, w, gx, gw in zip(xs, ws, grad_x, grad_w):
                if gx is not None:
                    torch.mm(grad, w, out=gx[rows])
                if gw is not None:
                    gw.addmm_(grad.t(), x[rows])
            del grad  # freed before the next chunk's product
        if parallel is not None:  # each shard's part of the hidden states' gradient, summed over the vocabulary
            for gx in grad_x:
                if gx is not None:
                    dist.all_reduce(gx, group=parallel[0])
        grads = [*grad_x, *grad_w]
        if bias is not None:
            grads.append(grad_b.to(bias.dtype) if grad_b is not None else None)
        # Kept on ctx (not save_for_backward: they are neither inputs nor outputs), scaled in place in backward.
        ctx.grads = grads
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise StateError("the chunked loss's gradients were used already: it supports one backward pass")
        for g in grads:
            if g is not None:
                g.mul_(grad_output)
        return (None,) * 8 + tuple(grads)
