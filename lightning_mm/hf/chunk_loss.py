"""The chunked cross-entropy for Transformers models (``enable_chunk_loss``), without a ``[tokens, vocab]`` tensor.

:func:`enable_chunk_loss` gives a Transformers causal LM or VLM (anything whose forward runs its
``get_output_embeddings()`` layer on the decoder's final hidden states, Qwen2.5-VL's and Qwen3-VL's
``model`` + ``lm_head`` included) three forward hooks, and changes nothing else:

* on the model (pre): a call with ``labels`` hands them (and Transformers' ``shift_labels`` /
  ``num_items_in_batch`` loss arguments) to the chunked loss instead of the model's own loss;
* on the output layer (pre, after FSDP2's own pre-forward hook): keeps the layer's input, the final hidden states,
  and lets the layer run on an empty slice of them (no logits are formed);
* on the output layer (post, before FSDP2's post-forward hook): computes
  :func:`~lightning_mm.core.chunked_loss.linear_cross_entropy` from the kept hidden states and the layer's weight,
  and returns the loss as the layer's output.

Inside the output layer's call the weight is the one FSDP2 has gathered (whether the layer is a unit of its own,
grouped with tied input embeddings, or part of the root), its pre-backward hook is registered on the loss, and the
gradient of the hidden states reaches the decoder through FSDP2's post-backward hook as before: sharding is
untouched. Under tensor parallelism the output layer is column-parallel (``core.tensor_parallel`` splits its rows,
the vocabulary, over the ``tp`` ranks) and the loss is the exact vocabulary-parallel cross-entropy of
:func:`~lightning_mm.core.chunked_loss.linear_cross_entropy` over the ``tp`` group. Tied embeddings are the
same parameter, so their gradients add up as in the full computation; LoRA on the head (PEFT's ``lora.Linear``)
adds one linear term per active adapter. The model's output then carries the loss in ``loss`` and
``logits=None``.

The normalisation is Transformers' ``ForCausalLMLoss``: labels shifted by one (``shift_labels`` when given), the
sum of the token losses over the number of targets that are not ``-100`` (or over ``num_items_in_batch``), per
call. Across data-parallel ranks the gradients are averaged as before, so training equals the unchunked run.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from torch import Tensor, nn

from lightning_mm.core.chunked_loss import (
    IGNORE_INDEX,
    ChunkedLossError,
    check_chunk_size,
    linear_cross_entropy,
    mark_chunked_head,
)
from lightning_mm.core.context_parallel import shift_labels

__all__ = ["ChunkedLossError", "enable_chunk_loss", "chunk_loss_size", "chunk_loss_target", "head_terms"]

_LOSS_KWARGS = ("shift_labels", "num_items_in_batch", "ignore_index")


@dataclass
class _Call:
    """One forward with labels: its targets, then the hidden states the head received, then the loss."""

    labels: Tensor
    shift_labels: Tensor | None
    num_items: Any
    ignore_index: int
    hidden: Tensor | None = None
    loss: Tensor | None = None


#: The models whose loss is chunked, and their hooks: kept here, not written on the user's model
#: (``chunk_loss_size`` reads it).
_ENABLED: weakref.WeakKeyDictionary[nn.Module, _ChunkLoss] = weakref.WeakKeyDictionary()


class _ChunkLoss:
    """The hooks that chunk one model's loss; kept in ``_ENABLED`` (holds no reference to the model)."""

    def __init__(self, model: nn.Module, head: nn.Module, chunk_size: int) -> None:
        self.model_name = type(model).__name__
        self.chunk_size = chunk_size
        self.call: _Call | None = None
        self.handles = [
            model.register_forward_pre_hook(self.take_labels, with_kwargs=True),
            head.register_forward_pre_hook(self.keep_hidden),
            head.register_forward_hook(self.compute, prepend=True),
            model.register_forward_hook(self.put_loss),
        ]

    def take_labels(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        self.call = None
        labels = kwargs.pop("labels", None)
        if labels is None:
            for key in _LOSS_KWARGS:
                if kwargs.get(key) is not None:
                    raise ChunkedLossError(f"{self.model_name}: `{key}` without `labels` (enable_chunk_loss)")
            return args, kwargs
        keep = kwargs.get("logits_to_keep")
        if keep is not None and not (isinstance(keep, int) and keep == 0):
            raise ChunkedLossError(
                f"{self.model_name}: `logits_to_keep={keep!r}` with `labels`: the chunked loss "
                "(enable_chunk_loss) needs the hidden states of every position"
            )
        ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
        self.call = _Call(
            labels, kwargs.pop("shift_labels", None), kwargs.pop("num_items_in_batch", None), int(ignore_index)
        )
        return args, kwargs

    def keep_hidden(self, head: nn.Module, args: tuple) -> tuple | None:
        call = self.call
        if call is None or call.hidden is not None or not args or not isinstance(args[0], Tensor):
            return None
        call.hidden = args[0]
        empty = args[0][..., :0, :]  # the layer itself runs on no positions
        weight = getattr(head, "weight", None)
        if _is_dtensor(weight) and not _is_dtensor(empty):  # vocabulary-parallel: a DTensor input for its forward
            from torch.distributed.tensor import DTensor, Replicate

            mesh = cast(DTensor, weight).device_mesh
            empty = DTensor.from_local(empty, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return (empty, *args[1:])

    def compute(self, head: nn.Module, args: tuple, output: Any) -> Any:
        call = self.call
        if call is None or call.hidden is None or call.loss is not None:
            return None
        hidden = call.hidden
        targets = call.shift_labels if call.shift_labels is not None else shift_labels(call.labels, call.ignore_index)
        targets = targets.to(hidden.device)
        if tuple(hidden.shape[:-1]) != tuple(targets.shape):
            raise ChunkedLossError(
                f"{self.model_name}: the output layer got hidden states {tuple(hidden.shape)} for labels "
                f"{tuple(targets.shape)} (enable_chunk_loss needs one hidden state per label; context parallelism "
                "and models that drop positions before the head are not supported with it)"
            )
        xs, ws, bias = head_terms(head, hidden)
        ws, bias, group, vocab_start = _vocab_shards(self.model_name, ws, bias)
        call.loss = linear_cross_entropy(
            xs,
            ws,
            targets,
            bias=bias,
            chunk_size=self.chunk_size,
            ignore_index=call.ignore_index,
            num_items=call.num_items,
            group=group,
            vocab_start=vocab_start,
        )
        return call.loss

    def put_loss(self, model: nn.Module, args: tuple, output: Any) -> Any:
        call, self.call = self.call, None
        if call is None:
            return None
        if call.loss is None:
            raise ChunkedLossError(
                f"{self.model_name}'s forward did not call its output layer "
                "(get_output_embeddings()); enable_chunk_loss cannot compute its loss"
            )
        logits = output.get("logits") if isinstance(output, dict) else None
        if logits is not call.loss:
            raise ChunkedLossError(
                f"{self.model_name} changes the output layer's result before returning it as `logits` (e.g. logit "
                "soft-capping or scaling), or returns a tuple: enable_chunk_loss computes the plain cross-entropy "
                "of the output layer and cannot be used with it"
            )
        output["loss"] = call.loss
        output["logits"] = None
        return output


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _vocab_shards(
    model_name: str, ws: list[Tensor], bias: Tensor | None
) -> tuple[list[Tensor], Tensor | None, Any, int]:
    """Plain weights: unchanged. A column-parallel output layer (tensor parallelism, its weight a DTensor split by
    rows over a 1-D ``tp`` mesh): the local shards of its weight and bias, the mesh's process group and the index of
    the rank's first vocabulary row (the vocabulary-parallel cross-entropy of ``linear_cross_entropy``)."""
    if not _is_dtensor(ws[0]):
        return ws, bias, None, 0
    from torch.distributed.tensor import DTensor, Shard

    weight = cast(DTensor, ws[0])
    mesh = weight.device_mesh
    for t in [*ws, *([bias] if bias is not None else [])]:
        if not (isinstance(t, DTensor) and t.device_mesh == mesh and mesh.ndim == 1 and t.placements == (Shard(0),)):
            raise ChunkedLossError(
                f"{model_name}: the output layer's weights are split {getattr(t, 'placements', 'not at all')}; the "
                "vocabulary-parallel chunked loss needs every weight of the layer split by rows over one tensor-"
                "parallel mesh (a column-parallel layer without LoRA)"
            )
    rows, size = weight.shape[0], mesh.size()
    if rows % size:
        raise ChunkedLossError(
            f"{model_name}: a vocabulary of {rows} does not divide over {size} tensor-parallel ranks"
        )
    local = [cast(DTensor, w).to_local() for w in ws]
    local_bias = cast(DTensor, bias).to_local() if bias is not None else None
    return local, local_bias, mesh.get_group(), mesh.get_local_rank() * (rows // size)


class _LoraLinear(Protocol):
    """What the chunked loss reads of PEFT's LoRA ``Linear`` (:func:`_is_lora_linear` checks that it is one)."""

    base_layer: nn.Linear
    lora_A: Mapping[str, nn.Linear]  # noqa: N815 - PEFT's names
    lora_B: Mapping[str, nn.Linear]  # noqa: N815
    lora_dropout: Mapping[str, Callable[[Tensor], Tensor]]
    scaling: Mapping[str, float]
    active_adapters: Sequence[str]
    disable_adapters: bool
    merged: bool


def _is_plain_linear(head: nn.Module) -> bool:
    """An ``nn.Linear`` computing ``x @ weight.T + bias`` (FSDP2 makes it an ``FSDPLinear`` with the same forward)."""
    return isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward


def _is_lora_linear(head: nn.Module) -> bool:
    """PEFT's LoRA ``Linear`` around an ``nn.Linear`` (``base_layer``, ``lora_A``, ``lora_B``, ``scaling``)."""
    base = getattr(head, "base_layer", None)
    return (
        base is not None
        and _is_plain_linear(base)
        and all(hasattr(head, a) for a in ("lora_A", "lora_B", "lora_dropout", "scaling", "active_adapters"))
    )


def _check_head(head: nn.Module) -> None:
    if _is_plain_linear(head):
        return
    if not _is_lora_linear(head):
        raise ChunkedLossError(
            f"enable_chunk_loss: the output layer is a {type(head).__name__}; the chunked loss needs an nn.Linear "
            "(or PEFT's LoRA Linear around one)"
        )
    lora = cast(_LoraLinear, head)
    variants = getattr(head, "lora_variant", None) or {}
    used = [a for a in lora.active_adapters if a in variants]
    if used and not (lora.disable_adapters or lora.merged):
        raise ChunkedLossError(
            f"enable_chunk_loss: the output layer's LoRA adapter(s) {used} use a variant (DoRA or "
            "another); only plain LoRA on the head is supported"
        )


def head_terms(head: nn.Module, hidden: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor | None]:
    """The output layer as ``sum_i xs[i] @ ws[i].T + bias``: an ``nn.Linear``, or PEFT's LoRA ``Linear``
    (one more term per active adapter: ``scaling * lora_A(dropout(hidden))`` with ``lora_B.weight``)."""
    _check_head(head)
    if _is_plain_linear(head):
        linear = cast(nn.Linear, head)
        return [hidden], [linear.weight], linear.bias
    lora = cast(_LoraLinear, head)  # _check_head: PEFT's LoRA Linear around an nn.Linear
    base = lora.base_layer
    xs: list[Tensor] = [hidden]
    ws: list[Tensor] = [base.weight]
    bias: Tensor | None = base.bias
    if lora.disable_adapters or lora.merged:
        return xs, ws, bias
    for name in lora.active_adapters:
        if name not in lora.lora_A:
            continue
        lora_a, lora_b = lora.lora_A[name], lora.lora_B[name]
        scaling = lora.scaling[name]
        xs.append(lora_a(lora.lora_dropout[name](hidden.to(lora_a.weight.dtype))) * scaling)
        ws.append(lora_b.weight)
        if lora_b.bias is not None:
            extra = lora_b.bias * scaling
            bias = extra if bias is None else bias + extra
    return xs, ws, bias


def enable_chunk_loss(model: nn.Module, chunk_size: int = 1024) -> None:
    """Compute ``model``'s loss in chunks of ``chunk_size`` tokens from now on (see the module docstring).

    ``model`` is a Transformers ``PreTrainedModel`` whose ``get_output_embeddings()`` is the layer its forward
    applies to the final hidden states. Call it before sharding (``TransformersModel`` and ``MMLightningModule``
    do); a second call with the same size does nothing, another size is an error.
    """
    chunk_size = check_chunk_size(chunk_size)
    existing = _ENABLED.get(model)
    if existing is not None:
        if existing.chunk_size != chunk_size:
            raise ChunkedLossError(
                f"{type(model).__name__} computes its loss in chunks of {existing.chunk_size} "
                f"tokens already; cannot also use {chunk_size}"
            )
        return
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Module):
        raise ChunkedLossError(
            f"enable_chunk_loss: {type(model).__name__} has no output layer (get_output_embeddings() gives "
            f"{type(head).__name__}); a custom model computes its loss with "
            "lightning_mm.core.chunked_loss.linear_cross_entropy itself"
        )
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(text, key, None) not in (None, 1, 1.0):
            raise ChunkedLossError(
                f"enable_chunk_loss: {type(model).__name__} transforms its logits "
                f"(`{key}`={getattr(text, key)!r}); the chunked loss is the plain cross-entropy"
            )
    _check_head(head)  # an unsupported head fails now, not at the first step
    _ENABLED[model] = _ChunkLoss(model, head, chunk_size)
    mark_chunked_head(head)  # under tensor parallelism the plan splits it by vocabulary


def chunk_loss_size(model: nn.Module) -> int | None:
    """The chunk size ``model`` computes its loss with, or ``None`` when :func:`enable_chunk_loss` was not called."""
    existing = _ENABLED.get(model)
    return existing.chunk_size if existing is not None else None


def chunk_loss_target(root: nn.Module) -> nn.Module:
    """The model in ``root`` whose loss :func:`enable_chunk_loss` chunks: ``root`` itself when it has an output
    layer, else the outermost Transformers ``PreTrainedModel`` inside it; else an error."""
    getter = getattr(root, "get_output_embeddings", None)
    if callable(getter) and isinstance(getter(), nn.Module):
        return root
    pretrained: type[nn.Module] | None
    try:
        from transformers import PreTrainedModel

        pretrained = PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is an optional extra
        pretrained = None
    found = next((m for m in root.modules() if pretrained is not None and isinstance(m, pretrained)), None)
    if found is None:
        raise ChunkedLossError(
            f"enable_chunk_loss: {type(root).__name__} is not a Transformers model and has no output layer "
            "(get_output_embeddings()); a custom model computes its loss with "
            "lightning_mm.core.chunked_loss.linear_cross_entropy itself"
        )
    return found
