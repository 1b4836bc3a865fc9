"""Packed batches (:mod:`lightning_mm.core.packed_rows`) as the forward inputs of a Transformers model.

A text model (Qwen3, Llama, ...) takes a packed row almost as it is: given ``position_ids`` that restart per
sample, no ``attention_mask`` and no key/value cache (``use_cache=False``: with a cache, which Transformers
creates by default even in training, it assumes one sequence per row), Transformers 5 builds a block-diagonal
causal mask for sdpa, eager and flex attention
(``masking_utils.find_packed_sequence_indices``) and runs flash-attention varlen with the samples' boundaries
(``modeling_flash_attention_utils``), and its rotary positions restart per sample.

A Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V, the Qwen2.5-Omni thinker: a model with
``get_rope_index``) needs more: its M-RoPE positions are 3-D and depend on each sample's images, and its decoder only
detects a packed row from 4-D ``position_ids`` whose first row holds the text positions (2-D ones would make
Qwen2.5-VL attend across samples and both fall back to 1-D positions for the images). :func:`packed_forward_inputs`
computes them per sample, with the model's own ``get_rope_index`` on that sample's tokens and its own
``image_grid_thw`` / ``video_grid_thw`` rows (and ``second_per_grid_ts`` / ``video_second_per_grid`` entries),
exactly as the model computes them for the sample alone, and stacks the text positions on top. Gemma 3
(``token_type_ids``: each image's tokens see each other both ways) gets its per-sample masks as one
``attention_mask`` dict (:func:`packed_block_masks`: Transformers' own sliding-window mask mixes up the samples'
images in a packed row). :func:`packed_forward_inputs` also sets ``use_cache=False``; :func:`install_packed_inputs`
applies it to every call of the model with a packed row (a forward pre-hook, installed by ``TransformersModel``) and
gives the layers with sequence state (Gated DeltaNet) their per-sample path (:mod:`lightning_mm.hf.packing_layers`).
Lightning-free.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mm._compat import attn_implementation
from lightning_mm.core.packed_rows import is_packed, segment_ids
from lightning_mm.errors import ConfigError, DataError

__all__ = [
    "PackedMasks",
    "packed_forward_inputs",
    "install_packed_inputs",
    "needs_multimodal_positions",
    "packed_block_masks",
]

BLOCK_MASK_MODELS = frozenset({"gemma3"})
"""Model types whose forward turns ``token_type_ids`` into a bidirectional mask over each image's tokens, and whose
packed rows get their per-layer-type masks from :func:`packed_block_masks`."""


class PackedMasks(dict):
    """Layer type (``full_attention``, ``sliding_attention``) -> the 4-D attention mask of a packed row, made by
    :func:`packed_block_masks`: the model's forward takes a dict ``attention_mask`` as its masks as they are."""


def _image_blocks(token_type_ids: Tensor) -> Tensor:
    """``(B, T)`` the index of the image each token belongs to (a run of ``token_type_ids`` 1), -1 for text."""
    image = token_type_ids == 1
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
    return torch.where(image, starts.long().cumsum(-1) - 1, -1)


def packed_block_masks(model: nn.Module, batch: Mapping[str, Any]) -> PackedMasks:
    """The masks Gemma 3 means for each packed sample, as one packed row's (``(B, 1, T, T)``).

    Per sample, as Gemma 3 builds them for a sample alone (``create_masks_for_vision_model``): full attention is
    causal or within one image (its tokens see each other both ways); sliding attention is that and at most
    ``sliding_window - 1`` positions back. No token sees another sample. Transformers' own masks cannot be used for
    a packed row: its sliding-window mask looks the image blocks up by each token's position in its sample instead
    of its place in the row, so every sample after the first would see the wrong tokens. Booleans (``True``: may
    attend) for sdpa, additive floats (0 or the dtype's minimum) for eager; other attention implementations are
    refused.
    """
    config: Any = model.config  # a Transformers config
    text: Any = config.get_text_config()
    attention = str(attn_implementation(text) or attn_implementation(config) or "")
    if attention not in ("sdpa", "eager"):
        raise ConfigError(
            f"{type(model).__name__}: packed rows with images need attn_implementation 'sdpa' or 'eager' here, got "
            f"{attention!r}"
        )
    positions: Tensor = batch["position_ids"]
    segments = segment_ids(positions)
    blocks = _image_blocks(batch["token_type_ids"].to(positions.device))
    q, k = positions[:, :, None], positions[:, None, :]
    same_sample = segments[:, :, None] == segments[:, None, :]
    same_image = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    full = ((k <= q) | same_image) & same_sample
    masks = {"full_attention": full, "sliding_attention": full & (k > q - int(text.sliding_window))}
    out = PackedMasks()
    for kind in dict.fromkeys(getattr(text, "layer_types", None) or ["full_attention"]):
        mask = masks[kind][:, None]
        if attention == "eager":
            low = torch.finfo(torch.float32).min
            mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, low)
        out[kind] = mask
    return out


def _inner(model: nn.Module) -> nn.Module | None:
    base = getattr(model, "base_model", None)
    if base is not None and hasattr(base, "get_rope_index"):
        return base
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "get_rope_index") else None


def needs_multimodal_positions(model: nn.Module) -> bool:
    """Whether ``model`` computes M-RoPE positions (a Qwen-VL inner model with ``get_rope_index``)."""
    return _inner(model) is not None


def _take(grid: Tensor | None, cursor: int, tokens: int, merge: int) -> tuple[Tensor | None, int]:
    """The grid rows whose placeholder tokens add up to ``tokens``, from row ``cursor`` on."""
    if grid is None or tokens == 0:
        return None, cursor
    start, count = cursor, 0
    while count < tokens and cursor < grid.shape[0]:
        count += int(grid[cursor].prod()) // merge**2
        cursor += 1
    if count != tokens:
        raise DataError(f"a packed sample holds {tokens} placeholder tokens, which do not match its grid rows")
    return grid[start:cursor], cursor


def packed_forward_inputs(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """For a packed row (``position_ids`` restarting per sample, no ``attention_mask``): ``batch`` with
    ``use_cache=False`` and, for a Qwen-VL model given 2-D ``position_ids``, 4-D ``(text + M-RoPE, B, T)`` ones
    computed per packed sample. Any other batch unchanged."""
    out = dict(batch)
    if batch.get("attention_mask") is not None or not is_packed(batch.get("position_ids")):
        return out
    positions: Tensor = batch["position_ids"]  # is_packed: a tensor
    out["use_cache"] = False
    config: Any = getattr(model, "config", None)
    if getattr(config, "model_type", None) in BLOCK_MASK_MODELS and isinstance(batch.get("token_type_ids"), Tensor):
        out["attention_mask"] = packed_block_masks(model, batch)
        return out
    # A Qwen-VL inner model: its config and get_rope_index are Transformers' own, untyped here.
    inner: Any = _inner(model)
    ids = batch.get("input_ids")
    if inner is None or positions.ndim != 2 or not isinstance(ids, Tensor) or ids.is_meta:
        return out
    types = batch.get("mm_token_type_ids")
    if types is None:  # Qwen2.5-Omni's thinker takes none: its placeholders mark the images (1) and videos (2)
        types = torch.zeros_like(ids)
        for value, names in (
            (1, ("image_token_id", "image_token_index")),
            (2, ("video_token_id", "video_token_index")),
        ):
            token = next((t for t in (getattr(inner.config, n, None) for n in names) if isinstance(t, int)), None)
            if token is not None:
                types = types.masked_fill(ids == token, value)
    merge = int(inner.config.vision_config.spatial_merge_size)
    rope_parameters = inspect.signature(inner.get_rope_index).parameters
    by_types = "mm_token_type_ids" in rope_parameters
    image_grid, video_grid = batch.get("image_grid_thw"), batch.get("video_grid_thw")
    # Seconds per temporal patch of each video: Qwen2.5-VL's ``second_per_grid_ts``; the Qwen2.5-Omni thinker's
    # ``video_second_per_grid``, which its forward passes to get_rope_index as ``second_per_grids``.
    seconds_key = "second_per_grid_ts" if "second_per_grid_ts" in rope_parameters else "second_per_grids"
    seconds = batch.get("second_per_grid_ts", batch.get("video_second_per_grid"))
    image_cursor = video_cursor = 0
    segments = segment_ids(positions)
    rope = torch.zeros(3, *ids.shape, dtype=positions.dtype, device=positions.device)
    for row in range(ids.shape[0]):
        for segment in torch.unique_consecutive(segments[row]).tolist():
            where = (segments[row] == segment).nonzero().flatten()
            lo, hi = int(where[0]), int(where[-1]) + 1
            seg_types = types[row : row + 1, lo:hi]
            images, image_cursor = _take(image_grid, image_cursor, int((seg_types == 1).sum()), merge)
            first_video = video_cursor
            videos, video_cursor = _take(video_grid, video_cursor, int((seg_types == 2).sum()), merge)
            sample_ids = ids[row : row + 1, lo:hi]
            extra: dict[str, Tensor] = {"mm_token_type_ids": seg_types} if by_types else {}
            if not by_types:  # Qwen2.5-Omni's thinker: the placeholders are read from the ids, the mask is required
                extra["attention_mask"] = torch.ones_like(sample_ids)
            if isinstance(seconds, Tensor) and videos is not None:  # its videos' seconds per grid step
                extra[seconds_key] = seconds[first_video:video_cursor]
            sample_positions, _ = inner.get_rope_index(
                sample_ids, image_grid_thw=images, video_grid_thw=videos, **extra
            )
            rope[:, row, lo:hi] = sample_positions[:, 0].to(rope.device)
    out["position_ids"] = torch.cat([positions[None], rope], dim=0)
    return out


def _hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    # A packed row has no attention_mask (Transformers' own rule): positions with one skip padding (generate's
    # left-padded prompts), and a packed row with one is the batch check's to refuse.
    if args or kwargs.get("attention_mask") is not None or not is_packed(kwargs.get("position_ids")):
        return None
    return args, packed_forward_inputs(module, kwargs)


def install_packed_inputs(model: nn.Module) -> Any:
    """Apply :func:`packed_forward_inputs` to every call of ``model`` with a packed row (a forward pre-hook), and
    run its layers with sequence state once per packed sample
    (:func:`~lightning_mm.hf.packing_layers.install_per_sample_layers`); returns the pre-hook's handle."""
    from lightning_mm.hf.packing_layers import install_per_sample_layers

    install_per_sample_layers(model)
    return model.register_forward_pre_hook(_hook, with_kwargs=True)
