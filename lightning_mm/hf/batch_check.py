"""Checks that a Transformers model really consumes a batch: every key, and every image.

A Transformers VLM's ``forward(**kwargs)`` swallows keys it does not use: a batch whose image key is misnamed
(``images`` for LLaVA, which takes ``pixel_values``) trains on text alone and exits 0. Images whose placeholder
tokens are missing from ``input_ids`` fail only deep in the model, or not at all. And Qwen2.5-VL without
``mm_token_type_ids`` (or 3-D ``position_ids``) silently falls back to 1-D positions instead of M-RoPE.
:func:`check_batch` turns each of these into a short :class:`BatchCheckError` before the batch reaches the model.

* Keys: a batch key must be an explicit parameter of the model's ``forward``, of its inner model's ``forward``
  (``model.model``: the one that runs the vision tower), of its language model's ``forward`` (``get_decoder()``:
  where a VLM's ``**kwargs`` end, e.g. ``use_cache``), or of their ``get_image_features`` /
  ``get_video_features``, or a key that a typed ``**kwargs: Unpack[TransformersKwargs]`` declares (packing's
  ``cu_seq_lens_q``, ``num_items_in_batch``, ...), or ``return_dict`` (taken by Transformers' forward wrapper).
  An untyped ``**kwargs`` takes nothing.
* Images and placeholders (config ``image_token_id`` / ``image_token_index``, ``video_token_id``): the tokens the
  images make must equal the placeholder tokens in ``input_ids``. Qwen-VL: ``prod(image_grid_thw) /
  spatial_merge_size**2`` per image (videos likewise with ``video_grid_thw``); LLaVA: ``(H / patch) * (W / patch)``
  per image (+1 for the ``full`` feature strategy); InternVL: ``(H / patch * downsample_ratio) * (W / patch *
  downsample_ratio)`` per tile; Gemma 3: ``mm_tokens_per_image`` per image; Mistral 3:
  ``(h / (patch * spatial_merge_size)) * (w / ...)`` per ``image_sizes`` row; Idefics3:
  ``(image_size / patch)**2 / scale_factor**2`` per image or crop that is not all-zero padding. Other VLMs:
  images need at least one placeholder, placeholders need images.
  Images that ``generate()`` has already encoded (``mm_encoder_outputs``) need at least one placeholder (the
  model compares the features with the placeholders itself).
* Qwen-VL (a model with ``get_rope_index`` whose forward takes ``mm_token_type_ids``): a batch with images needs
  ``mm_token_type_ids`` or 3-D ``position_ids``; ``mm_token_type_ids`` must mark exactly the image (1) and video
  (2) placeholder tokens.

* Packed rows (``position_ids`` that restart within a row, :mod:`lightning_mm.core.packed_rows`): Transformers keeps the
  samples apart only without an ``attention_mask`` (it then derives a block-diagonal mask from the positions), so a
  packed row with one is refused, as is one without ``use_cache=False`` (with a key/value cache, created by default,
  Transformers assumes one sequence per row); a Qwen-VL model needs 4-D ``position_ids`` (text row first, then the
  M-RoPE rows computed per sample: :func:`lightning_mm.hf.packed_inputs.packed_forward_inputs`), since from 2-D ones its
  decoder would attend across samples or fall back to 1-D image positions (3-D M-RoPE positions alone do not mark
  where samples start: Transformers, and this check, see one sample per row). A packed row with ``token_type_ids``
  (Gemma 3's bidirectional image masks) needs the per-sample masks of
  :func:`lightning_mm.hf.packed_inputs.packed_block_masks` as its ``attention_mask``, and is refused for other models.
  The varlen keys ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` are read only by flash-attention: with another attention implementation they are refused (sdpa
  and eager would swallow them and attend across samples). Every layer of the language model must be of a kind that
  keeps packed samples apart (:func:`lightning_mm.hf.packing_layers.packing_refusal`, an allow-list: softmax
  attention with full or sliding-window masks, per-token parts such as MLPs, norms and MoE blocks, and Gated
  DeltaNet run once per sample); any other layer (Mamba, a causal convolution, an unknown kind) is refused by
  class and module path.

Only Transformers models (``PreTrainedModel``) are checked; a plain module without ``**kwargs`` already refuses an
unknown key itself. Lightning-free.

Where it runs: :func:`install_batch_check` registers :class:`BatchCheckHook` as a forward pre-hook (with kwargs) on
a model, so every call ``model(**batch)`` (or ``model(input_ids, ...)``) is checked, whoever makes it: MindSpeed MM's
``forward_step``, an overriding module, a plain LightningModule, ``generate``. ``TransformersModel`` installs it on
every model it builds. The first call of each kind (the model's train/eval mode, the grad or inference mode, and
the set of keys given) is checked in full; later calls of that kind cost a set lookup. The hook survives FSDP2's
``fully_shard`` (which keeps the module's hooks and puts its own first: a call is checked after its parameters are
gathered, before any compute), recomputation (which replays sub-modules, never the root's hooks) and meta-device
construction (a meta ``input_ids`` is not counted). :class:`BatchCheck` is the same check for a caller that runs it
itself (the default ``forward_step`` of ``MMLightningModule``, for a Transformers model not built by
``TransformersModel``).
"""

from __future__ import annotations

import inspect
import typing
import weakref
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_mm._compat import attn_implementation
from lightning_mm.errors import DataError

__all__ = [
    "BatchCheckError",
    "BatchCheck",
    "BatchCheckHook",
    "check_batch",
    "install_batch_check",
    "has_batch_check",
    "forward_keys",
    "expected_image_tokens",
]


class BatchCheckError(DataError):
    """A batch that the model would not consume as given (a key it ignores, images without placeholders, ...)."""


def _hf_model(model: Any) -> nn.Module | None:
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        return None
    from transformers import PreTrainedModel

    return model if isinstance(model, PreTrainedModel) else None


def _inner(model: nn.Module) -> nn.Module | None:
    """The inner model that holds the towers (``model.model`` of a ``...ForConditionalGeneration``)."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else None


def _parameters(fn: Any) -> tuple[set[str], set[str]]:
    """The named parameters of ``fn``, and the keys of a typed ``**kwargs: Unpack[SomeTypedDict]``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), set()
    names: set[str] = set()
    typed_keys: set[str] = set()
    for name, parameter in signature.parameters.items():
        if name == "self" or parameter.kind is parameter.VAR_POSITIONAL:
            continue
        if parameter.kind is parameter.VAR_KEYWORD:
            for typed in typing.get_args(parameter.annotation):  # Unpack[TransformersKwargs] -> (TransformersKwargs,)
                typed_keys |= set(getattr(typed, "__required_keys__", ()))
                typed_keys |= set(getattr(typed, "__optional_keys__", ()))
            continue
        names.add(name)
    return names, typed_keys


def _decoder(model: nn.Module) -> nn.Module | None:
    """The language model that a VLM's ``**kwargs`` reach last (``get_decoder()``), if the model names one."""
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except Exception:  # noqa: BLE001 - Transformers raises several kinds for models without a decoder
        return None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


# Taken by Transformers' own forward wrapper (``can_return_tuple``) on every model, so in no signature.
_CALL_OPTIONS = frozenset({"return_dict"})


def _model_keys(model: nn.Module) -> tuple[set[str], set[str]]:
    explicit: set[str] = set(_CALL_OPTIONS)
    typed: set[str] = set()
    owners = dict.fromkeys(o for o in (model, _inner(model), _decoder(model)) if o is not None)
    for owner in owners:
        for method in ("forward", "get_image_features", "get_video_features"):
            fn = getattr(type(owner), method, None)
            if fn is not None:
                names, keys = _parameters(fn)
                explicit |= names
                typed |= keys
    return explicit, typed - explicit


def forward_keys(model: nn.Module) -> frozenset[str]:
    """The batch keys ``model`` consumes (see the module docstring): what the key check accepts."""
    explicit, typed = _model_keys(model)
    return frozenset(explicit | typed)


def _tensor(batch: Mapping[str, Any], key: str) -> torch.Tensor | None:
    value = batch.get(key)
    return value if isinstance(value, torch.Tensor) and value.numel() > 0 else None


def _token_id(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


def expected_image_tokens(model: nn.Module, batch: Mapping[str, Any], video: bool = False) -> int | None:
    """The placeholder tokens that the batch's images (or videos) fill, or ``None`` if this model's rule is unknown."""
    config: Any = model.config  # a Transformers config: its fields differ per model type
    vision: Any = getattr(config, "vision_config", None)
    grid = _tensor(batch, "video_grid_thw" if video else "image_grid_thw")
    merge = getattr(vision, "spatial_merge_size", None)
    if grid is not None and isinstance(merge, int):  # Qwen-VL: one token per merged group of patches
        return int((grid.long().prod(-1) // merge**2).sum())
    pixels = _tensor(batch, "pixel_values_videos" if video else "pixel_values")
    model_type = getattr(config, "model_type", None)
    if not video and pixels is not None and pixels.ndim == 5 and model_type == "idefics3":
        # (samples, images, C, H, W), all-zero padding images dropped; pixel-shuffled patches per image (crop)
        real = int((pixels.flatten(2) != 0).any(-1).sum())
        side = int(vision.image_size) // int(vision.patch_size)
        return real * (side * side) // int(config.scale_factor) ** 2
    if video or pixels is None or pixels.ndim != 4 or vision is None:
        return None
    patch = _pair(getattr(vision, "patch_size", 0) or 0)
    if not all(patch):
        return None
    rows, cols = pixels.shape[-2] // patch[0], pixels.shape[-1] // patch[1]
    sizes = _tensor(batch, "image_sizes")
    if model_type == "mistral3" and sizes is not None:  # Pixtral: one token per merged patch of each image's size
        cell = patch[0] * int(getattr(config, "spatial_merge_size", 1))
        return int(((sizes[:, 0] // cell) * (sizes[:, 1] // cell)).sum())
    if model_type == "gemma3":  # each image pooled to mm_tokens_per_image soft tokens
        return pixels.shape[0] * int(config.mm_tokens_per_image)
    if model_type == "llava" and batch.get("image_sizes") is None:
        strategy = batch.get("vision_feature_select_strategy") or getattr(
            config, "vision_feature_select_strategy", None
        )
        return pixels.shape[0] * (rows * cols + (1 if strategy == "full" else 0))
    if model_type == "internvl":
        ratio = float(getattr(config, "downsample_ratio", 1.0))
        return pixels.shape[0] * int(rows * ratio) * int(cols * ratio)
    return None


def _check_keys(model: nn.Module, batch: Mapping[str, Any]) -> None:
    explicit, typed = _model_keys(model)
    unknown = sorted(k for k, v in batch.items() if v is not None and k not in explicit and k not in typed)
    if unknown:
        name = type(model).__name__.removeprefix("FSDP")
        typed_note = f" (and the keyword arguments {', '.join(sorted(typed))})" if typed else ""
        raise BatchCheckError(
            f"batch key(s) {', '.join(repr(k) for k in unknown)} are not taken by {name}: its forward would "
            f"swallow them and train without them. It takes: {', '.join(sorted(explicit))}{typed_note}"
        )


def _check_tokens(model: nn.Module, batch: Mapping[str, Any]) -> None:
    ids = _tensor(batch, "input_ids")
    if ids is None or ids.is_meta:
        return  # inputs_embeds, or a trace on the meta device: nothing to count
    config = model.config
    counts: dict[str, int] = {}
    for kind, video, token_names, pixel_key in (
        ("image", False, ("image_token_id", "image_token_index"), "pixel_values"),
        ("video", True, ("video_token_id", "video_token_index"), "pixel_values_videos"),
    ):
        token = _token_id(config, *token_names)
        if token is None:
            continue
        placeholders = int((ids == token).sum())
        counts[kind] = placeholders
        if _encoded(batch, kind):  # generate() encodes the images first: the model compares the features itself
            if not placeholders:
                raise BatchCheckError(
                    f"the batch has encoded {kind}s (`mm_encoder_outputs`) but input_ids holds no {kind} placeholder "
                    f"token ({token_names[0]} {token})"
                )
            continue
        given = _tensor(batch, pixel_key) is not None
        if not given and placeholders:
            raise BatchCheckError(
                f"input_ids holds {placeholders} {kind} placeholder tokens ({token_names[0]} {token}) but the batch "
                f"has no `{pixel_key}`"
            )
        if not given:
            continue
        expected = expected_image_tokens(model, batch, video=video)
        if expected is None and placeholders == 0:
            raise BatchCheckError(
                f"the batch has `{pixel_key}` but input_ids holds no {kind} placeholder token ({token_names[0]} "
                f"{token}): the {kind}s would not reach the language model"
            )
        if expected is not None and expected != placeholders:
            raise BatchCheckError(
                f"the batch's {kind}s make {expected} {kind} tokens but input_ids holds {placeholders} {kind} "
                f"placeholder tokens ({token_names[0]} {token})"
            )
    _check_mrope(model, batch, counts)


def _encoded(batch: Mapping[str, Any], kind: str) -> bool:
    """Whether ``generate()``'s pre-encoded ``mm_encoder_outputs`` hold this modality (``image``, ``video``)."""
    encoded = batch.get("mm_encoder_outputs")
    return isinstance(encoded, Mapping) and encoded.get(kind) is not None


def _check_mrope(model: nn.Module, batch: Mapping[str, Any], counts: dict[str, int]) -> None:
    inner = _inner(model)
    if inner is None or not hasattr(inner, "get_rope_index") or "mm_token_type_ids" not in forward_keys(model):
        return
    visual = [
        k
        for k in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")
        if _tensor(batch, k) is not None
    ]
    visual += ["mm_encoder_outputs"] if _encoded(batch, "image") or _encoded(batch, "video") else []
    if not visual:
        return
    types = _tensor(batch, "mm_token_type_ids")
    positions = _tensor(batch, "position_ids")
    if types is None:
        if positions is not None and positions.ndim == 3:
            return
        raise BatchCheckError(
            f"the batch has {', '.join(visual)} but neither `mm_token_type_ids` nor 3-D `position_ids`: "
            f"{type(model).__name__.removeprefix('FSDP')} needs one of them for its M-RoPE positions (the processor "
            "returns `mm_token_type_ids` with `input_ids`)"
        )
    for kind, value in (("image", 1), ("video", 2)):
        marked = int((types == value).sum())
        if kind in counts and marked != counts[kind]:
            raise BatchCheckError(
                f"mm_token_type_ids marks {marked} {kind} tokens (value {value}) but input_ids holds {counts[kind]} "
                f"{kind} placeholder tokens"
            )


_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _restarts_among_real_tokens(positions: torch.Tensor, mask: Any) -> bool:
    """Whether the positions of the tokens that ``mask`` keeps restart within a row (samples packed together)."""
    from lightning_mm.core.packed_rows import segment_ids

    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return True
    segments = segment_ids(positions)
    if segments.shape != mask.shape:
        return True
    for row, keep in zip(segments, mask.bool()):
        real = row[keep]
        if real.numel() > 1 and bool((real != real[0]).any()):
            return True
    return False


def _check_packing(model: nn.Module, batch: Mapping[str, Any]) -> None:
    from lightning_mm.core.packed_rows import is_packed

    name = type(model).__name__.removeprefix("FSDP")
    varlen = [k for k in _VARLEN_KEYS if batch.get(k) is not None]
    attention = str(attn_implementation(model.config) or "")
    if varlen and "flash" not in attention:
        raise BatchCheckError(
            f"batch key(s) {', '.join(varlen)} are read only by flash-attention, but {name} runs "
            f"attn_implementation {attention!r}, which would swallow them and attend across the packed samples: "
            "give position_ids that restart per sample instead (Transformers then masks each sample to itself)"
        )
    positions = _tensor(batch, "position_ids")
    if positions is None or positions.is_meta or not is_packed(positions):
        return
    from lightning_mm.hf.packed_inputs import BLOCK_MASK_MODELS, PackedMasks

    mask = batch.get("attention_mask")
    config: Any = model.config  # a Transformers config
    block_masks = getattr(config, "model_type", None) in BLOCK_MASK_MODELS
    if batch.get("token_type_ids") is not None and not (block_masks and isinstance(mask, PackedMasks)):
        raise BatchCheckError(
            f"the batch is packed and has token_type_ids, from which {name} builds masks over a whole row (e.g. "
            "each image's tokens seeing each other) that are not proven to keep packed samples apart"
            + (
                ": TransformersModel computes its per-sample masks "
                "(lightning_mm.hf.packed_inputs.packed_forward_inputs)"
                if block_masks
                else ": train this model unpacked"
            )
        )
    if isinstance(mask, PackedMasks):
        pass  # the per-sample masks of lightning_mm.hf.packed_inputs.packed_block_masks
    elif mask is not None:
        if not _restarts_among_real_tokens(positions, mask):
            return  # positions that skip padding (generate's left-padded prompts): one sample per row
        raise BatchCheckError(
            f"the batch is packed (position_ids restart within a row) and has an attention_mask: {name} would then "
            "attend across the packed samples (Transformers derives the per-sample mask from position_ids only "
            "without an attention_mask); drop attention_mask from packed batches"
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    caches = any(getattr(c, "use_cache", False) is not False for c in (config, text_config))
    if batch.get("use_cache") is not False and caches:
        raise BatchCheckError(
            f"the batch is packed (position_ids restart within a row) but the call does not set use_cache=False: "
            f"{name} would create a key/value cache, and Transformers keeps packed samples apart only without one "
            "(TransformersModel sets it; for another model call lightning_mm.hf.packed_inputs.packed_forward_inputs)"
        )
    if (
        _inner(model) is not None
        and hasattr(_inner(model), "get_rope_index")
        and not (positions.ndim == 3 and positions.shape[0] == 4)
    ):
        raise BatchCheckError(
            f"the batch is packed, but {name} computes M-RoPE positions and needs 4-D position_ids for a packed "
            f"row (the text positions, then the M-RoPE positions of each sample), got shape {tuple(positions.shape)}"
            ": TransformersModel computes them (lightning_mm.hf.packed_inputs.install_packed_inputs); for another "
            "model "
            "call lightning_mm.hf.packed_inputs.packed_forward_inputs(model, batch)"
        )
    from lightning_mm.hf.packing_layers import packing_refusal

    refusal = packing_refusal(model)
    if refusal is not None:
        raise BatchCheckError(
            f"the batch is packed, but {name} cannot train it exactly as its samples unpacked: {refusal}"
        )


def check_batch(model: nn.Module, batch: Mapping[str, Any]) -> None:
    """Raise :class:`BatchCheckError` if ``model(**batch)`` would not consume ``batch`` as given.

    A no-op for a model that is not a Transformers ``PreTrainedModel``. Reads the batch (a few reductions over
    ``input_ids``), never the model's parameters.
    """
    hf = _hf_model(model)
    if hf is None or not isinstance(batch, Mapping):
        return
    _check_keys(hf, batch)
    _check_packing(hf, batch)
    _check_tokens(hf, batch)


class BatchCheck:
    """:func:`check_batch` once per kind of batch: the first batch of each ``context`` (e.g. the trainer, its entry
    point and stage) and key set is checked in full; later ones cost a set lookup."""

    def __init__(self) -> None:
        self._checked: set[Hashable] = set()

    def __call__(self, model: nn.Module, batch: Mapping[str, Any], context: Hashable = None) -> None:
        if not isinstance(batch, Mapping):
            return
        key = (context, id(type(model)), frozenset(batch))
        if key in self._checked:
            return
        check_batch(model, batch)
        self._checked.add(key)


def _positional_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the arguments ``model.forward`` takes by position, in order (``input_ids`` first)."""
    try:
        signature = inspect.signature(type(model).forward)
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(name for name, p in signature.parameters.items() if name != "self" and p.kind in kinds)


class BatchCheckHook:
    """A forward pre-hook (``register_forward_pre_hook(hook, with_kwargs=True)``) that checks each call's inputs.

    The call's keyword arguments, plus positional ones under their parameter names, are checked with
    :func:`check_batch`: in full on the first call of each kind (``module.training``, ``torch.is_grad_enabled()``,
    ``torch.is_inference_mode_enabled()``, the set of keys given), a set lookup afterwards. So the first training
    step, the first validation step of a fit, the first step under inference mode (``validate``, ``test``,
    ``predict``) and the first ``generate`` step are each checked before they compute. The hook changes no input
    and holds no reference to the model (a deep copy or a pickle of the model carries its own).
    """

    def __init__(self) -> None:
        self._check = BatchCheck()
        self._names: dict[type, tuple[str, ...]] = {}

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs: Mapping[str, Any] = kwargs
        if args:
            names = self._names.get(type(module))
            if names is None:
                names = self._names[type(module)] = _positional_names(module)
            inputs = {**dict(zip(names, args)), **kwargs}
        mode = (module.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self._check(module, inputs, mode)


_INSTALLED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def install_batch_check(model: nn.Module) -> Any:
    """Check every call of ``model`` (a Transformers model) with a :class:`BatchCheckHook`; returns its handle.

    Idempotent: a model that has one already keeps it (and its handle is returned). ``handle.remove()`` takes the
    check off again.
    """
    handle = _INSTALLED.get(model)
    if handle is not None:
        return handle
    handle = _Handle(model, model.register_forward_pre_hook(BatchCheckHook(), with_kwargs=True))
    _INSTALLED[model] = handle
    return handle


def has_batch_check(model: Any) -> bool:
    """Whether :func:`install_batch_check` put a check on ``model`` (then each of its calls is checked)."""
    return isinstance(model, nn.Module) and model in _INSTALLED


class _Handle:
    """The hook's handle; removing it also forgets that ``model`` is checked."""

    def __init__(self, model: nn.Module, handle: Any) -> None:
        self._model = weakref.ref(model)
        self._handle = handle

    def remove(self) -> None:
        self._handle.remove()
        model = self._model()
        if model is not None and _INSTALLED.get(model) is self:
            del _INSTALLED[model]
