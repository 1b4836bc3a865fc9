"""Ulysses and KV all-gather context parallelism for Hugging Face models, without user code.

:func:`enable_context_parallel` prepares a Transformers model for a context-parallel group:

* its text decoder (``model.get_decoder()``: ``Qwen3Model``, Qwen2.5-VL's / InternVL's ``language_model``) gets a
  forward pre-hook that takes the decoder's inputs for the whole sequence (token embeddings, or the embeddings in
  which a VLM has already placed its image/video features; position ids, including Qwen2.5-VL's 3-D multimodal
  RoPE positions, which the model computed for the whole sequence) and keeps this rank's slice of them. The
  sequence is padded at its end to a multiple of ``C``; padded keys are masked, padded targets ignored;
* the decoder config's attention implementation becomes ``ulysses_<inner>``, registered in Transformers'
  ``AttentionInterface``: an all-to-all to (whole sequence, ``heads / C``), the configured ``eager`` or ``sdpa``
  attention with a causal + padding mask of the whole sequence, and the inverse all-to-all. Every model whose
  decoder attention calls ``ALL_ATTENTION_FUNCTIONS`` is routed;
* a packed row (``position_ids`` restarting per sample, :mod:`lightning_mm.core.packed_rows`) splits like any
  sequence: the attention's mask of the whole sequence is then also block-diagonal over its samples;
* a layer with state along the sequence of :data:`~lightning_mm.hf.packing_layers.PER_SAMPLE_CLASSES` (Gated
  DeltaNet: Qwen3.5, Qwen3.5-MoE, Qwen3-Next) gets a wrapped ``forward``
  (:func:`~lightning_mm.core.module_state.replace_forward`): its input is gathered over the group
  (:func:`~lightning_mm.core.context_parallel.gather_sequence`, whose backward is a reduce-scatter), the layer runs
  on the whole padded sequence (once per sample of a packed row, its state starting from zero at each; the
  caller's padding mask of the whole sequence), and the rank keeps its slice of the output. Every rank computes
  the whole layer; each rank's parameter gradients hold what its own slice of the output contributes, and the
  group's gradient reduction (FSDP2 over ``dp x cp`` with the loss scaled by ``C``, as for every other layer)
  sums them once;
* the model gets a pre-hook that takes ``labels`` out of the call and a hook that puts the loss of the whole
  sequences (:func:`~lightning_mm.core.context_parallel.context_parallel_loss`) into ``output.loss``.

The vision tower and the embeddings run on whole sequences on each rank of the group (their activations are
small next to the decoder's); the decoder layers, the final norm and the LM head see ``seq / C`` tokens (a Gated
DeltaNet layer computes on the whole sequence, as above).
Generation (a key/value cache) is not supported under context parallelism.

With ``context_parallel_algo: kv_allgather`` (MindSpeed MM's ``megatron_cp_algo``,
:mod:`lightning_mm.core.ring_attention`) the pre-hook keeps the rank's zig-zag chunks (``r`` and ``2 C - 1 - r`` of
``2 C``; the sequence is padded to a multiple of ``2 C``) of the embeddings, the position ids (M-RoPE's too) and the
targets, and the attention implementation is ``kv_allgather_<inner>``: the rank's queries attend to the keys and
values of the whole sequence gathered over the group, under a mask built from the queries' global positions
(causal, padding, and a packed row's samples). No head is scattered: any head count works. Sliding-window and
chunked attention are refused before any step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mm._compat import attn_implementation, set_attn_implementation
from lightning_mm.core.context_parallel import (
    IGNORE_INDEX,
    ContextParallelError,
    activation_bytes_estimate,
    all_to_all,
    check_heads,
    context_parallel_loss,
    context_parallel_plan,
    gather_sequence,
    shift_labels,
    split_sequence,
)
from lightning_mm.core.module_state import replace_forward
from lightning_mm.core.packed_rows import is_packed, segment_ids
from lightning_mm.core.ring_attention import (
    kv_allgather_attention,
    zigzag_causal_mask,
    zigzag_causal_sdpa,
    zigzag_gather,
    zigzag_index,
    zigzag_padded_length,
    zigzag_split,
)
from lightning_mm.hf.chunk_loss import chunk_loss_size
from lightning_mm.hf.packing_layers import PER_SAMPLE_CLASSES, context_parallel_refusal, mark_sequence_gathered

__all__ = ["ROUTABLE", "enable_context_parallel", "find_hf_model", "check_routable", "context_parallel_summary"]

ROUTABLE = ("eager", "sdpa")
PREFIX = "ulysses_"
KV_PREFIX = "kv_allgather_"
_PREFIXES = {"ulysses": PREFIX, "kv_allgather": KV_PREFIX}


def _inner(impl: str) -> str:
    """The attention implementation under a routing prefix (``ulysses_sdpa`` -> ``sdpa``)."""
    for prefix in _PREFIXES.values():
        impl = impl.removeprefix(prefix)
    return impl


class _State:
    """What the attention function needs of the current forward: the group and the keys that are real."""

    group: Any = None
    key_valid: Tensor | None = None
    all_valid: bool = True
    """No padding in the caller's attention mask (only the end padding to a multiple of ``C``)."""
    labels: Tensor | None = None
    segments: Tensor | None = None
    """``(B, padded S)`` sample index of every token of a packed row (``None``: not packed)."""
    algo: str = "ulysses"
    query_index: Tensor | None = None
    """``kv_allgather``: the global positions of this rank's tokens (its zig-zag chunks)."""
    masks: dict[Any, Tensor] = {}
    """``kv_allgather``: the masks of the current forward (see :func:`_kv_mask`)."""


def _split(t: Tensor, dim: int, pad_value: float | int = 0) -> Tensor:
    """This rank's tokens of a whole-sequence tensor: a contiguous slice (Ulysses) or the zig-zag chunks."""
    if _STATE.algo == "kv_allgather":
        return zigzag_split(t, dim, _STATE.group, pad_value)
    return split_sequence(t, dim, _STATE.group, pad_value)


def _gather(t: Tensor, dim: int) -> Tensor:
    """The whole padded sequence (natural order) from every rank's tokens (the inverse of :func:`_split`)."""
    if _STATE.algo == "kv_allgather":
        return zigzag_gather(t, dim, _STATE.group)
    return gather_sequence(t, dim, _STATE.group)


def _local(full: Tensor, dim: int) -> Tensor:
    """This rank's tokens of an already padded whole sequence (no collective)."""
    if _STATE.algo == "kv_allgather":
        assert _STATE.query_index is not None
        return full.index_select(dim, _STATE.query_index.to(full.device))
    size, rank = torch.distributed.get_world_size(_STATE.group), torch.distributed.get_rank(_STATE.group)
    local = full.shape[dim] // size
    return full.narrow(dim, rank * local, local).clone()


_STATE = _State()


def _ulysses(inner: str) -> Any:
    def attention(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
    ) -> tuple[Tensor, None]:
        import sys

        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.llama.modeling_llama import eager_attention_forward

        if kwargs.get("sliding_window") is not None:
            raise ContextParallelError("sliding-window attention is not supported under context parallelism")
        group = _STATE.group
        q, k, v = (all_to_all(t, 1, 2, group) for t in (query, key, value))  # (B, H/C, S, D)
        causal = getattr(module, "is_causal", True)
        kwargs.pop("is_causal", None)
        if inner == "sdpa" and causal and _STATE.all_valid and _STATE.segments is None:
            # Only end padding: causal attention alone keeps real tokens off the padded keys, and sdpa can use
            # its flash kernel without an O(S^2) mask.
            mask, kwargs["is_causal"] = None, True
        else:
            mask = _full_mask(q, causal)
        # The model's own eager function (the same math in every family), else Llama's.
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", eager_attention_forward)
        fn = eager if inner == "eager" else sdpa_attention_forward
        out, _ = fn(module, q, k, v, mask, **kwargs)  # (B, S, H/C, D)
        return all_to_all(out, 1, 2, group), None  # (B, S/C, H, D)

    attention.__name__ = f"{PREFIX}{inner}"
    return attention


def _kv_allgather(inner: str) -> Any:
    def attention(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
    ) -> tuple[Tensor, None]:
        import sys

        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.llama.modeling_llama import eager_attention_forward

        if kwargs.get("sliding_window") is not None:
            raise ContextParallelError("sliding-window attention is not supported under context parallelism")
        assert _STATE.query_index is not None and _STATE.key_valid is not None
        causal = getattr(module, "is_causal", True)
        kwargs.pop("is_causal", None)
        group = _STATE.group
        if inner == "sdpa" and causal and _STATE.all_valid and _STATE.segments is None:
            # Only end padding: each chunk attends to a prefix of the keys, lower-right causal; no dense mask.
            rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
            scale, dropout = kwargs.get("scaling"), float(kwargs.get("dropout", 0.0) or 0.0)

            def chunks(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                out = zigzag_causal_sdpa(q, k, v, rank, size, scale, dropout, _STATE.masks)
                return out.transpose(1, 2).contiguous()

            return kv_allgather_attention(chunks, query, key, value, group), None
        mask = _kv_mask(query, causal, inner == "sdpa")
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", eager_attention_forward)
        fn = eager if inner == "eager" else sdpa_attention_forward

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out, _ = fn(module, q, k, v, mask, **kwargs)  # (B, local, H, D)
            return out

        return kv_allgather_attention(attend, query, key, value, group), None

    attention.__name__ = f"{KV_PREFIX}{inner}"
    return attention


def _kv_mask(query: Tensor, causal: bool, boolean: bool) -> Tensor:
    """The ``(B or 1, 1, local, padded)`` mask of this rank's queries over the whole sequence (causal, padding,
    packed samples): boolean for sdpa, additive for eager; built once per forward and shared by the layers (one
    storage saved for backward, not one per layer)."""
    assert _STATE.query_index is not None and _STATE.key_valid is not None
    key = (causal, boolean, query.dtype, query.device)
    cached = _STATE.masks.get(key)
    if cached is None:
        allowed = zigzag_causal_mask(
            _STATE.query_index.to(query.device),
            _STATE.key_valid.shape[1],
            causal,
            _STATE.key_valid,  # the end padding too: a non-causal layer would see it
            _STATE.segments,
        )
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        cached = allowed if boolean else torch.where(allowed, zero, torch.finfo(query.dtype).min)
        _STATE.masks[key] = cached
    return cached


def _full_mask(q: Tensor, causal: bool) -> Tensor:
    """An additive ``(B, 1, S, S)`` mask of the whole padded sequence: causal, padded keys masked."""
    s = q.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed)
    allowed = allowed[None, None]
    if _STATE.key_valid is not None:
        allowed = allowed & _STATE.key_valid[:, None, None, :].to(q.device)
    if _STATE.segments is not None:  # a packed row: each sample attends only to itself
        segments = _STATE.segments.to(q.device)
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    return torch.where(allowed, zero, torch.finfo(q.dtype).min)


def _register() -> None:
    from transformers import AttentionInterface

    for inner in ROUTABLE:
        AttentionInterface.register(f"{PREFIX}{inner}", _ulysses(inner))
        AttentionInterface.register(f"{KV_PREFIX}{inner}", _kv_allgather(inner))


def find_hf_model(root: nn.Module) -> nn.Module | None:
    """The outermost Transformers ``PreTrainedModel`` in ``root`` (``root`` itself included), or ``None``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is an optional extra
        return None
    return next((m for m in root.modules() if isinstance(m, PreTrainedModel)), None)


def _check_layers(model: nn.Module) -> None:
    """Refuse a language model with a layer that carries state along the sequence (Gated DeltaNet, Mamba, ...)."""
    refusal = context_parallel_refusal(model)
    if refusal is not None:
        raise ContextParallelError(f"{type(model).__name__}: {refusal}")


def _check_full_attention(name: str, config: Any) -> None:
    """KV all-gather masks full (causal) attention only: refuse sliding-window and chunked attention by config."""
    kinds = set(getattr(config, "layer_types", None) or ())
    # linear attention (Gated DeltaNet) runs on the gathered sequence; _check_layers vets those layers
    other = sorted(k for k in kinds if k not in ("full_attention", "linear_attention"))
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    chunked = getattr(config, "attention_chunk_size", None) is not None
    if other or (not kinds and sliding) or chunked:
        what = f"layer types {other}" if other else ("chunked attention" if chunked else "sliding-window attention")
        raise ContextParallelError(
            f"{name}: context_parallel_algo kv_allgather masks full causal attention only; this decoder has {what}; "
            "use context_parallel_algo ulysses or context_parallel_size 1"
        )


def check_routable(model: nn.Module, size: int, algo: str = "ulysses") -> nn.Module:
    """The decoder of ``model`` if it can run context-parallel with ``size`` ranks under ``algo``; else a clear
    error: a layer that carries state along the sequence
    (:func:`~lightning_mm.hf.packing_layers.context_parallel_refusal`), attention that cannot be routed, for Ulysses
    heads that do not divide by ``size``, for KV all-gather sliding-window or chunked attention."""
    name = type(model).__name__
    hf: Any = model  # a Transformers model: get_decoder() is Transformers' own, untyped
    try:
        decoder: nn.Module = hf.get_decoder()
    except Exception as err:  # noqa: BLE001 - Transformers raises several kinds for models without a decoder
        raise ContextParallelError(f"{name}: no text decoder to run context-parallel ({err})") from None
    _check_layers(model)
    config = decoder.config
    impl = attn_implementation(config) or "eager"
    inner = _inner(impl)
    if inner not in ROUTABLE:
        raise ContextParallelError(
            f"{name}: attention implementation {impl!r} cannot be routed through context_parallel_algo {algo} "
            f"(supported: {ROUTABLE}); load the model with attn_implementation='sdpa' or 'eager'"
        )
    if algo == "kv_allgather":
        _check_full_attention(name, config)
        return decoder
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise ContextParallelError(f"{name}: its decoder config has no num_attention_heads; cannot split heads")
    check_heads(heads, getattr(config, "num_key_value_heads", None), size, name)
    return decoder


def enable_context_parallel(model: nn.Module, group: Any, algo: str = "ulysses") -> nn.Module:
    """Route ``model`` (a Transformers model) through ``algo`` (``ulysses`` or ``kv_allgather``) over ``group``;
    returns its decoder."""
    if chunk_loss_size(model) is not None:  # lightning_mm.hf.chunk_loss
        raise ContextParallelError(
            f"{type(model).__name__}: enable_chunk_loss is not supported with context parallelism; turn one of them off"
        )
    _check_layers(model)  # before anything touches the group
    size = torch.distributed.get_world_size(group)
    decoder = check_routable(model, size, algo)
    _register()
    set_attn_implementation(decoder.config, _PREFIXES[algo] + _inner(attn_implementation(decoder.config) or "eager"))
    _STATE.group, _STATE.algo = group, algo
    for module in decoder.modules():
        if type(module).__name__.removeprefix("FSDP") in PER_SAMPLE_CLASSES:
            reason = "context parallelism: runs on the whole sequence gathered over the group"
            replace_forward(module, _whole_sequence(module, module.forward), reason)
            mark_sequence_gathered(module)
    decoder.register_forward_pre_hook(_split_decoder_inputs, with_kwargs=True)
    model.register_forward_pre_hook(_take_labels, with_kwargs=True)
    model.register_forward_hook(_put_loss)
    return decoder


_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _whole_sequence(module: nn.Module, forward: Any) -> Any:
    """``forward`` of a layer with state along the sequence, run on the whole sequence of the group (see the
    module docstring); ``hidden_states`` is this rank's ``(B, S / C, ...)`` slice, and so is the result."""
    name = type(module).__name__

    def whole_sequence_forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
            raise ContextParallelError(f"{name}: runs without a cache under context parallelism")
        for key in _VARLEN_KEYS:  # boundaries from a rank's slice of the positions: the whole row's are below
            kwargs.pop(key, None)
        full = _gather(hidden_states, 1)  # (B, padded S, ...), natural order
        segments = _STATE.segments
        if segments is None:
            valid = _STATE.key_valid
            kwargs["attention_mask"] = None if _STATE.all_valid or valid is None else valid.to(full.device)
            out = forward(full, **kwargs)
        else:  # a packed row: one call per sample (the end padding to a multiple of C is a last one)
            if full.shape[0] != 1 or segments.shape != full.shape[:2]:
                raise ContextParallelError(
                    f"{name}: a packed row must be one row of the whole sequence, got {tuple(full.shape[:2])} "
                    f"for samples of shape {tuple(segments.shape)}"
                )
            row = segments[0].to(full.device)
            starts = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist(), row.shape[0]]
            kwargs["attention_mask"] = None
            out = torch.cat([forward(full[:, lo:hi], **kwargs) for lo, hi in zip(starts, starts[1:])], dim=1)
        return _local(out, 1)

    return whole_sequence_forward


def _split_decoder_inputs(decoder: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    group = _STATE.group
    if args:  # input_ids given positionally
        kwargs = {"input_ids": args[0], **kwargs}
        args = ()
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise ContextParallelError("generation with a key/value cache is not supported under context parallelism")
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        hf: Any = decoder  # a Transformers decoder: get_input_embeddings() is Transformers' own
        embeds = hf.get_input_embeddings()(kwargs["input_ids"])
    batch, seq = embeds.shape[:2]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=embeds.device).expand(batch, seq)
    mask = kwargs.get("attention_mask")
    if mask is not None and (not isinstance(mask, Tensor) or mask.ndim != 2):
        raise ContextParallelError("context parallelism takes a 2-D (batch, seq) padding attention_mask or none")
    valid = mask.bool() if mask is not None else torch.ones(1, seq, dtype=torch.bool, device=embeds.device)
    size = torch.distributed.get_world_size(group)
    padded = zigzag_padded_length(seq, size) if _STATE.algo == "kv_allgather" else -(-seq // size) * size
    rank = torch.distributed.get_rank(group)
    _STATE.query_index = zigzag_index(padded, size, rank, embeds.device) if _STATE.algo == "kv_allgather" else None
    _STATE.masks = {}
    _STATE.all_valid = mask is None or bool(mask.all())
    _STATE.key_valid = torch.cat([valid, valid.new_zeros(valid.shape[0], padded - seq)], dim=1)
    _STATE.segments = None
    if mask is None and is_packed(positions):  # the row's samples (Transformers' rule: packed rows have no mask)
        segments = segment_ids(positions)
        _STATE.segments = torch.cat([segments, segments.new_full((segments.shape[0], padded - seq), -1)], dim=1)
    kwargs.update(
        input_ids=None,
        inputs_embeds=_split(embeds, 1),
        position_ids=_split(positions, positions.ndim - 1),
        attention_mask=None,
        use_cache=False,
    )
    return args, kwargs


def _take_labels(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    _STATE.labels = kwargs.pop("labels", None)
    return args, kwargs


def _put_loss(model: nn.Module, args: tuple, output: Any) -> Any:
    labels, _STATE.labels = _STATE.labels, None
    if labels is None:
        return output
    targets = _split(shift_labels(labels), labels.ndim - 1, pad_value=IGNORE_INDEX)
    loss = context_parallel_loss(output.logits, targets, _STATE.group)
    if isinstance(output, dict):  # a ModelOutput: key and attribute
        output["loss"] = loss
    else:
        output.loss = loss
    return output


def context_parallel_summary(
    target: nn.Module,
    world_size: int,
    size: int,
    algo: str = "ulysses",
    seq_len: int | None = None,
    handled: bool = False,
    tp: int = 1,
) -> str:
    """The context-parallel part of ``lightning-mm plan``: the mesh, the checks of :func:`check_routable`, and
    with ``seq_len`` the tokens and (estimated, 16-bit) decoder activation memory per rank for one sequence.
    ``handled``: the LightningModule runs its own context-parallel attention (``handles_context_parallel``, e.g.
    MMWanModule), so a model that is not a Transformers one is no error."""
    plan = context_parallel_plan(world_size, size, algo, tp)
    model = find_hf_model(target)
    activations = None
    if model is not None:
        hf: Any = model  # a Transformers model: get_decoder() and the config are Transformers' own
        decoder = check_routable(model, size, plan.algo) if plan.enabled else hf.get_decoder()
        config: Any = decoder.config
        if seq_len and getattr(config, "hidden_size", None) and getattr(config, "num_hidden_layers", None):
            activations = activation_bytes_estimate(config.hidden_size, config.num_hidden_layers, seq_len)
    elif plan.enabled and not handled:
        raise ContextParallelError(
            f"context_parallel_size {size}: {type(target).__name__} is not a Transformers "
            "model; its LightningModule must set `handles_context_parallel = True`"
        )
    return plan.describe(seq_len, activations)
