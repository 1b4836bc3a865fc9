"""Padding-free packing: several samples in one row, each attending only to itself.

A packed batch is one row (``input_ids`` of shape ``(1, T)``) holding the samples one after the other, without
padding, with:

* ``position_ids`` ``(1, T)`` restarting at 0 at the start of every sample: this is how Transformers recognises a
  packed row (``masking_utils.find_packed_sequence_indices`` for sdpa/eager/flex, ``_is_packed_sequence`` for
  flash-attention varlen) and gives each sample its own block of a block-diagonal causal mask; rotary positions
  restart with it;
* ``labels`` with the first token of every sample set to ``-100``: the causal-LM loss shifts labels by one, so
  this is the target of the previous sample's last token, which must not learn to predict the next sample. (A
  sample's first label is never a target unpacked either, so the loss is exactly the unpacked one.)
* no ``attention_mask``: Transformers derives the packed mask from ``position_ids`` only without one.

Per-image tensors are concatenated in sample order, as the padded collators do and as each family's forward takes
them: Qwen-VL ``pixel_values`` patches and ``image_grid_thw`` rows (videos: ``pixel_values_videos``,
``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``, the Qwen2.5-Omni thinker's ``video_second_per_grid``),
Gemma 3 images ``(N, C, H, W)``, Pixtral
(Mistral 3) images zero-padded to the largest height and width with their ``image_sizes`` rows (the vision tower
crops each image back to its size); Idefics3's one row of images per sample (``pixel_values`` ``(1, N, C, H, W)``
with ``pixel_attention_mask`` ``(1, N, H, W)``) becomes the packed row's one row of all the samples' images
(concatenated along the images, zero-padded to the largest height and width; the model drops all-zero images and
masks the padded pixels, as in a padded batch). Fixed-size images (``images`` ``(C, H, W)`` per sample) are
stacked.

:func:`segment_ids` and :func:`block_causal_mask` are the same rule for a custom model: the mask a custom
attention (``scaled_dot_product_attention(attn_mask=...)`` or eager) needs to keep samples apart.

Lightning-free and Transformers-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mm.errors import DataError

__all__ = [
    "IGNORE_INDEX",
    "PackedCollator",
    "PackingError",
    "segment_ids",
    "block_causal_mask",
    "is_packed",
    "packed_lengths",
]

IGNORE_INDEX = -100
TOKEN_KEYS = ("input_ids", "labels", "mm_token_type_ids", "token_type_ids")
"""Per-token keys: concatenated along the row."""
CONCAT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "video_second_per_grid",
    "image_sizes",
)
"""Per-image keys: concatenated along their first dimension (the Qwen-VL forward takes all patches as one),
zero-padded to the largest size of their other dimensions (Pixtral images of different sizes)."""
VISUAL_KEYS = ("pixel_values", "pixel_values_videos")
"""A sample with one of these has an image or a video: a row with none of them gets the filler image (MindSpeed
MM's rule, as :class:`~lightning_mm.hf.chat_collate.ChatCollator` applies it to padded batches)."""
ROW_KEYS = ("pixel_values", "pixel_attention_mask")
"""Per-sample rows of images (Idefics3: ``(1, N, ...)``, with ``pixel_attention_mask``): concatenated along the
images (dimension 1), zero-padded to the largest size of the others."""


class PackingError(DataError):
    """Samples that cannot be packed as given."""


def segment_ids(position_ids: Tensor) -> Tensor:
    """``(B, T)`` sample index of every token of packed rows, from positions that restart at each sample's start.

    The rule is Transformers' (``find_packed_sequence_indices``): a new sample starts wherever a position is not
    its predecessor plus one. 4-D multimodal positions (Qwen-VL: text row, then 3 M-RoPE rows) take their text
    row; 3-D M-RoPE positions alone do not delimit samples (image tokens share positions), as for Transformers:
    one sample per row.
    """
    if position_ids.ndim == 3:
        if position_ids.shape[0] != 4:
            return torch.zeros_like(position_ids[0])
        position_ids = position_ids[0]
    if position_ids.ndim == 1:
        position_ids = position_ids[None]
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def is_packed(position_ids: Any) -> bool:
    """Whether ``position_ids`` (2-D, or 4-D multimodal with the text row first) restart within a row."""
    if not isinstance(position_ids, Tensor) or position_ids.numel() == 0 or position_ids.is_meta:
        return False
    return bool((segment_ids(position_ids)[:, -1] > 0).any())


def packed_lengths(position_ids: Tensor) -> list[list[int]]:
    """The lengths of the samples packed into each row of ``position_ids``."""
    segments = segment_ids(position_ids)
    return [torch.bincount(row).tolist() for row in segments]


def block_causal_mask(position_ids: Tensor, causal: bool = True) -> Tensor:
    """``(B, 1, T, T)`` boolean mask (``True``: may attend) keeping each packed sample to itself (and causal)."""
    segments = segment_ids(position_ids)
    mask = segments[:, None, :, None] == segments[:, None, None, :]
    if causal:
        length = segments.shape[-1]
        mask = mask & torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return mask


def _row(value: Any, key: str, index: int) -> Tensor:
    tensor = torch.as_tensor(value)
    if tensor.ndim == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.ndim != 1:
        raise PackingError(f"sample {index}: `{key}` must be one sequence (1-D), got shape {tuple(tensor.shape)}")
    return tensor.long()


def _padded_cat(parts: list[Tensor], key: str, dim: int) -> Tensor:
    """``parts`` concatenated along ``dim``, each zero-padded (``False``) at the end of the dimensions after it."""
    if len({p.ndim for p in parts}) != 1 or parts[0].ndim <= dim:
        raise PackingError(f"samples' `{key}` have different or too few dimensions: {[tuple(p.shape) for p in parts]}")
    if dim and any(p.shape[:dim] != (1,) * dim for p in parts):
        raise PackingError(f"`{key}`: each sample must hold one row of images, got {[tuple(p.shape) for p in parts]}")
    size = [max(p.shape[d] for p in parts) for d in range(parts[0].ndim)]
    size[dim] = sum(p.shape[dim] for p in parts)
    out = parts[0].new_zeros(size)
    at = 0
    for p in parts:
        region = [slice(0, n) for n in p.shape]
        region[dim] = slice(at, at + p.shape[dim])
        out[tuple(region)] = p
        at += p.shape[dim]
    return out


class PackedCollator:
    """Packs a batch's samples into one row (see the module docstring).

    Samples have ``input_ids`` and ``labels`` (lists or 1-D tensors), optionally ``mm_token_type_ids`` /
    ``token_type_ids``, per-image tensors (:data:`CONCAT_KEYS`, :data:`ROW_KEYS`: concatenated) and ``stack_keys``
    (fixed-size images, stacked). An
    ``attention_mask`` must be all ones (a padded sample cannot be packed) and is dropped. ``filler`` (a
    sample's worth of tokens and vision tensors, as :class:`~lightning_mm.hf.chat_collate.ChatCollator` takes it)
    is appended as a sample of its own, without targets, to a row that has neither an image nor a video
    (:data:`VISUAL_KEYS`), so every rank runs the vision tower. Any other key is an error.
    """

    def __init__(self, stack_keys: Sequence[str] = (), filler: dict[str, Tensor] | None = None) -> None:
        self.stack_keys = tuple(stack_keys)
        self.filler = filler

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Tensor]:
        if not samples:
            raise PackingError("no sample to pack")
        samples = list(samples)
        if self.filler is not None and not any(k in s for s in samples for k in VISUAL_KEYS):
            filler = {k: v for k, v in self.filler.items() if k != "attention_mask"}
            filler["labels"] = torch.full((len(filler["input_ids"]),), IGNORE_INDEX, dtype=torch.long)
            samples.append(filler)
        keys = set().union(*(s.keys() for s in samples))
        rows = "pixel_attention_mask" in keys  # Idefics3: one row of images per sample
        unknown = keys - set(TOKEN_KEYS) - set(CONCAT_KEYS) - set(ROW_KEYS) - set(self.stack_keys) - {"attention_mask"}
        if unknown:
            raise PackingError(
                f"samples have keys the packing collate function does not know how to pack: {sorted(unknown)}"
            )
        columns: dict[str, list[Tensor]] = {k: [] for k in TOKEN_KEYS if k in keys}
        positions: list[Tensor] = []
        for index, sample in enumerate(samples):
            ids = _row(sample["input_ids"], "input_ids", index)
            if ids.numel() == 0:
                raise PackingError(f"sample {index} has no token")
            mask = sample.get("attention_mask")
            if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
                raise PackingError(f"sample {index} has padding (attention_mask 0): pack unpadded samples")
            for key in columns:
                if key not in sample:
                    raise PackingError(f"sample {index} has no `{key}` but others have")
                value = _row(sample[key], key, index)
                if value.numel() != ids.numel():
                    raise PackingError(f"sample {index}: `{key}` has {value.numel()} tokens, input_ids {ids.numel()}")
                if key == "labels":
                    value = value.clone()
                    value[0] = IGNORE_INDEX  # the previous sample's last token must not predict this one
                columns[key].append(value)
            positions.append(torch.arange(ids.numel()))
        batch = {key: torch.cat(parts)[None] for key, parts in columns.items()}
        batch["position_ids"] = torch.cat(positions)[None]
        for key in dict.fromkeys((*ROW_KEYS, *CONCAT_KEYS) if rows else CONCAT_KEYS):
            parts = [torch.as_tensor(s[key]) for s in samples if key in s]
            if parts:
                batch[key] = _padded_cat(parts, key, 1 if rows and key in ROW_KEYS else 0)
        for key in self.stack_keys:
            parts = [torch.as_tensor(s[key]) for s in samples if key in s]
            if parts:
                batch[key] = torch.stack(parts)
        return batch
