"""Which layers of a Transformers model keep packed samples apart, and the per-sample path of those that need one.

Transformers keeps the samples of a packed row apart only in its softmax attention, through ``position_ids`` that
restart per sample (``masking_utils``: causal, sliding-window). A layer with state along the sequence does not see
them: Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next linear attention) carries its recurrent state and its causal
``conv1d`` window from one packed sample into the next, and trains with no error. Transformers' torch code takes no
sample boundaries there (``torch_chunk_gated_delta_rule`` and ``causal_conv1d_fn`` swallow ``cu_seqlens``; only
the optional flash-linear-attention kernel reads it, and its convolution does not), so:

* :data:`PER_SAMPLE_CLASSES` (Gated DeltaNet): :func:`install_per_sample_layers` runs each such layer once per
  packed sample (its state starts from zero at every sample, as unpacked); its decoder layer gets a forward
  pre-hook that turns the layer's text ``position_ids`` into the samples' boundaries (``cu_seq_lens_q``, the name
  Transformers' kwargs already carry down to the token mixer), and the layer's ``forward`` is wrapped
  (:func:`~lightning_mm.core.module_state.replace_forward`) to run ``forward(hidden_states[:, start:end])`` per
  sample and concatenate. Exact (the tests compare with plain Transformers on the padded samples).
* Everything else in the language model must be a kind proven to keep packed samples apart
  (:func:`packing_refusal`): an explicit allow-list, so an unknown layer with state is refused, not trained wrong.
  Kinds: PyTorch's own per-token modules (``nn.Linear``, ``nn.Embedding``, norms, activations, dropout; not
  ``nn.Conv1d`` or recurrent ones), Transformers' activations, PEFT's adapter wrappers, Transformers classes named
  as per-token parts (``...MLP``, ``...RMSNorm``, ``...SparseMoeBlock``, ``...Experts``, ``...TopKRouter``,
  ``...RotaryEmbedding``, ...) or as softmax attention (``...Attention``, in a decoder layer whose
  ``config.layer_types`` entry, where the config has them, is ``full_attention`` or ``sliding_attention``), and
  containers (``...DecoderLayer``, ``...Model``, ``...ForCausalLM``: their parts are checked one by one). A class
  whose name marks sequence state (Mamba, mixer, convolution, recurrent, linear attention, ...) outside
  :data:`PER_SAMPLE_CLASSES`, a ``layer_types`` entry outside the list (``mamba``, ``conv``,
  ``chunked_attention``, ``hybrid``, ...) or a class of none of these kinds is refused, naming its class and path.

The batch check (:mod:`lightning_mm.hf.batch_check`) refuses a packed batch with :func:`packing_refusal` before the
model computes anything. Context parallelism (:func:`~lightning_mm.hf.cp_attention.check_routable`, at ``plan`` and
at setup) refuses a model with :func:`context_parallel_refusal`, the same allow-list: each rank runs every layer but
softmax attention and :data:`PER_SAMPLE_CLASSES` on its slice of the sequence; a Gated DeltaNet layer runs on the
whole sequence gathered over the group (:func:`~lightning_mm.hf.cp_attention.enable_context_parallel`, which then
also keeps a packed row's samples apart: :func:`mark_sequence_gathered`). Lightning-free.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_mm.core.module_state import add_input_hook, replace_forward
from lightning_mm.core.packed_rows import is_packed, segment_ids
from lightning_mm.errors import DataError

__all__ = [
    "PER_SAMPLE_CLASSES",
    "context_parallel_refusal",
    "SAFE_LAYER_TYPES",
    "install_per_sample_layers",
    "mark_sequence_gathered",
    "packing_refusal",
    "sample_boundaries",
]

PER_SAMPLE_CLASSES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"})
"""Layers with sequence state whose ``forward(hidden_states, cache=None, attention_mask=None, **kwargs)`` runs
one packed sample at a time here (Transformers' Gated DeltaNet)."""

SAFE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
"""``config.layer_types`` entries whose Transformers mask keeps packed samples apart (from ``position_ids``)."""

PER_SAMPLE_LAYER_TYPES = frozenset({"linear_attention"})
"""``config.layer_types`` entries allowed when their token mixer is one of :data:`PER_SAMPLE_CLASSES`."""

_PER_TOKEN = re.compile(
    r"(MLP|Mlp|FeedForward|RMSNorm|RMSNormGated|LayerNorm|Norm|RotaryEmbedding|SparseMoeBlock|MoeBlock|MoE|Moe|"
    r"Experts|Expert|TopKRouter|Router|Gate|Embedding|Embeddings)$"
)
_CONTAINER = re.compile(r"(DecoderLayer|Model|ForCausalLM|ForConditionalGeneration)$")
_SOFTMAX_ATTENTION = re.compile(r"Attention$")
_SEQUENCE_STATE = re.compile(
    r"Mamba|Mixer|DeltaNet|Delta|LinearAttention|Lightning|Recurrent|RgLru|RGLRU|Conv|SSM|Ssm|Lstm|LSTM|Rwkv|RWKV|"
    r"Hyena|Retention|Gla|GLA"
)
_TORCH_SEQUENCE_STATE = (nn.Conv1d, nn.RNNBase)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

_INSTALLED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_GATHERED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def mark_sequence_gathered(module: nn.Module) -> None:
    """``module`` (one of :data:`PER_SAMPLE_CLASSES`) runs on the whole sequence gathered over a context-parallel
    group and splits a packed row into its samples there: :func:`install_per_sample_layers` leaves it alone (its
    boundaries from a rank's slice of ``position_ids`` would be wrong) and packing accepts it."""
    _GATHERED.add(module)
    _INSTALLED.add(module)


def sample_boundaries(position_ids: Tensor) -> Tensor:
    """``cu_seqlens`` (``int32``, ``[0, end_1, ..., T]``) of the samples packed in a one-row ``position_ids``."""
    segments = segment_ids(position_ids)[0]
    counts = torch.bincount(segments)
    zero = torch.zeros(1, dtype=torch.int32, device=position_ids.device)
    return torch.cat([zero, counts.cumsum(0).to(torch.int32)])


def _boundaries_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    """A decoder layer's pre-hook: its text ``position_ids`` of a packed row -> ``cu_seq_lens_q`` for its mixer."""
    if any(child in _GATHERED for child in module.children()):
        return None  # context parallelism: its mixer takes the whole row's boundaries (a slice's would be wrong)
    positions = kwargs.get("position_ids")
    if kwargs.get("cu_seq_lens_q") is not None or not isinstance(positions, Tensor) or not is_packed(positions):
        return None
    if any(kwargs.get(k) is not None for k in ("attention_mask", "cache", "past_key_values")):
        return None  # positions that skip padding (generate's left-padded prompts) or a cached decode: one sample
    if positions.ndim != 2 or positions.shape[0] != 1:
        raise DataError(
            f"{type(module).__name__}: a packed batch must be one row of 2-D text position_ids here, got shape "
            f"{tuple(positions.shape)}"
        )
    return args, {**kwargs, "cu_seq_lens_q": sample_boundaries(positions)}


def _per_sample(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    name = type(module).__name__

    def per_sample_forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        bounds = kwargs.pop("cu_seq_lens_q", None)
        for key in _VARLEN_KEYS[1:]:
            kwargs.pop(key, None)
        if bounds is None:
            return forward(hidden_states, *args, **kwargs)
        if args or kwargs.get("cache") is not None or kwargs.get("attention_mask") is not None:
            raise DataError(f"{name}: a packed row runs without a cache and without an attention_mask")
        edges = [int(e) for e in bounds.tolist()]
        if hidden_states.shape[0] != 1 or edges[0] != 0 or edges[-1] != hidden_states.shape[1]:
            raise DataError(
                f"{name}: cu_seq_lens_q {edges} do not cover the packed row of shape {tuple(hidden_states.shape)}"
            )
        parts = [forward(hidden_states[:, lo:hi], **kwargs) for lo, hi in zip(edges, edges[1:])]
        return torch.cat(parts, dim=1)

    return per_sample_forward


def _parent(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path.rpartition(".")[0])


def install_per_sample_layers(model: nn.Module) -> list[str]:
    """Run every :data:`PER_SAMPLE_CLASSES` layer of ``model`` once per packed sample (see the module docstring);
    returns their paths. Idempotent; a batch that is not packed runs them as before."""
    paths = []
    for path, module in model.named_modules():
        if _class_name(module) not in PER_SAMPLE_CLASSES or not path:
            continue
        paths.append(path)
        if module in _INSTALLED or module in _GATHERED:
            continue
        reason = "packing: one call per packed sample (sequence state restarts at each sample)"
        replace_forward(module, _per_sample(module, module.forward), reason)
        add_input_hook(_parent(model, path), _boundaries_hook, "packing: sample boundaries (cu_seq_lens_q)")
        _INSTALLED.add(module)
    return paths


def _class_name(module: nn.Module) -> str:
    return type(module).__name__.removeprefix("FSDP")


def _decoder(model: nn.Module) -> tuple[str, nn.Module]:
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except Exception:  # noqa: BLE001 - Transformers raises several kinds for models without a decoder
        decoder = None
    if not isinstance(decoder, nn.Module):
        return "", model
    for path, module in model.named_modules():
        if module is decoder:
            return path, decoder
    return "", model


def _layer_types(model: nn.Module) -> list[str] | None:
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    return [str(t) for t in types] if isinstance(types, (list, tuple)) else None


class _Layer(NamedTuple):
    """A layer of the language model that does not keep a sequence's parts apart by itself."""

    kind: str
    """``layer_type`` (a ``config.layer_types`` entry outside the proven ones), ``per_sample`` (one of
    :data:`PER_SAMPLE_CLASSES`), ``state`` (sequence state by its class) or ``unknown`` (a kind not proven)."""
    path: str
    name: str
    layer_type: str | None


def _unproven_layer(model: nn.Module, per_sample_ok: bool, gathered_ok: bool = False) -> _Layer | None:
    """The first layer of ``model``'s language model not proven to keep packed samples apart; with
    ``per_sample_ok``, a :data:`PER_SAMPLE_CLASSES` layer whose per-sample path is installed counts as proven; with
    ``gathered_ok`` (context parallelism), every :data:`PER_SAMPLE_CLASSES` layer (it runs on the whole sequence)."""
    prefix, decoder = _decoder(model)
    layer_types = _layer_types(model)
    where = f"{prefix}." if prefix else ""
    inside: list[str] = []  # the paths of per-sample layers: their own parts run per sample with them
    for path, module in decoder.named_modules():
        if any(path.startswith(f"{p}.") for p in inside):
            continue
        name = _class_name(module)
        full = f"{where}{path}" if path else prefix or "<model>"
        owner = type(module).__module__
        match = _LAYER_INDEX.search(path)
        index = int(match.group(1)) if match else -1
        layer_type = layer_types[index] if layer_types and 0 <= index < len(layer_types) else None
        if layer_type is not None and layer_type not in SAFE_LAYER_TYPES | PER_SAMPLE_LAYER_TYPES:
            return _Layer("layer_type", full, name, layer_type)
        if name in PER_SAMPLE_CLASSES:
            if not gathered_ok and (not per_sample_ok or module not in _INSTALLED):
                return _Layer("per_sample", full, name, layer_type)
            inside.append(path)
            continue
        if isinstance(module, _TORCH_SEQUENCE_STATE):
            return _Layer("state", full, name, layer_type)
        if owner.startswith(("torch.", "peft.", "transformers.activations")):
            continue  # PyTorch's and Transformers' per-token modules, PEFT's adapter wrappers (and their base layers)
        if _CONTAINER.search(name):
            continue  # its parts are checked one by one
        if _PER_TOKEN.search(name):
            continue
        if _SEQUENCE_STATE.search(name):
            return _Layer("state", full, name, layer_type)
        if _SOFTMAX_ATTENTION.search(name) and (layer_type is None or layer_type in SAFE_LAYER_TYPES):
            continue
        return _Layer("unknown", full, name, layer_type)
    return None


def packing_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot train a packed row exactly as its samples unpacked, naming the layer's class and module
    path, or ``None`` when every layer of its language model is of a kind that keeps packed samples apart."""
    layer = _unproven_layer(model, per_sample_ok=True)
    if layer is None:
        return None
    full, name = layer.path, layer.name
    if layer.kind == "layer_type":
        return (
            f"layer {full} ({name}) is of kind {layer.layer_type!r} (config.layer_types), which packing does not "
            f"keep apart per sample here (proven kinds: {', '.join(sorted(SAFE_LAYER_TYPES))}, and "
            f"{', '.join(sorted(PER_SAMPLE_CLASSES))} for linear_attention)"
        )
    if layer.kind == "per_sample":
        return (
            f"layer {full} ({name}) carries state along the sequence, and its per-sample path is not "
            "installed: build the model with TransformersModel, or call "
            "lightning_mm.hf.packed_inputs.install_packed_inputs(model)"
        )
    if layer.kind == "state":
        return _state_refusal(full, name)
    return (
        f"layer {full} ({name}) is of a kind not proven to keep packed samples apart (a layer with state "
        "along the sequence would carry it from one packed sample into the next): train this model unpacked"
    )


def context_parallel_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s language model cannot run under Ulysses context parallelism, naming the layer's class and
    module path, or ``None``. Ulysses gathers the whole sequence inside softmax attention, and
    :func:`~lightning_mm.hf.cp_attention.enable_context_parallel` runs each :data:`PER_SAMPLE_CLASSES` layer (Gated
    DeltaNet) on the whole sequence gathered over the group; every other layer runs on its rank's slice, so another
    layer with state along the sequence (Mamba, a causal convolution, ...) would restart it at each slice's start
    and train wrong with no error. The same allow-list as packing (:func:`packing_refusal`)."""
    layer = _unproven_layer(model, per_sample_ok=False, gathered_ok=True)
    if layer is None:
        return None
    kind = f"of kind {layer.layer_type!r} (config.layer_types)" if layer.kind == "layer_type" else ""
    what = {
        "state": "carries state along the sequence",
        "layer_type": f"is {kind}, not softmax attention",
        "unknown": "is of a kind not proven to run on a slice of the sequence (a layer with state along it would "
        "restart that state at the slice)",
    }[layer.kind]
    return (
        f"layer {layer.path} ({layer.name}) {what}: under context parallelism each rank runs it on its own slice "
        "of the sequence, which would restart its state at every slice and train wrong; train this model with "
        "context_parallel_size 1"
    )


def _state_refusal(path: str, name: str) -> str:
    return (
        f"layer {path} ({name}) carries state along the sequence, from one packed sample into the next, and "
        "Transformers gives it no per-sample path usable here: train this model unpacked (packing=False)"
    )
