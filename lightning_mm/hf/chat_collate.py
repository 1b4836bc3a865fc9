"""The collate function of :class:`~lightning_mm.hf.chat_samples.ChatSampleBuilder` samples (MindSpeed MM's
``DataCollatorForQwen2vl``): right padding, vision tensors concatenated as each family's forward takes them."""

from __future__ import annotations

from typing import Any

import torch

from lightning_mm.errors import DataError

__all__ = ["ChatCollator", "TOKEN_KEYS", "VISION_KEYS"]

IGNORE_INDEX = -100
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")
"""Per-token keys: padded on the right to the longest sample."""
VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    "pixel_attention_mask",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "video_second_per_grid",
)
"""Per-image keys: concatenated along their first dimension, in sample order, each zero-padded (``False`` for a
mask) to the largest size of its other dimensions, as the families' processors batch them: Qwen-VL and GLM-4V
take all patches of a batch as one tensor with one ``image_grid_thw`` row per image; Gemma 3 one image per row;
Pixtral (Mistral 3) images padded to the largest height and width, with ``image_sizes``; Idefics3 one
row per sample of images (crops) padded to the most images, with ``pixel_attention_mask``. Videos (Qwen-VL): all
patches as one tensor, one ``video_grid_thw`` row and one seconds-per-temporal-patch value per video."""


class ChatCollator:
    """Pads ``input_ids`` with ``pad_token_id``, ``attention_mask`` and ``mm_token_type_ids`` with 0, and ``labels``
    with -100 (``ignore_pad_token_for_loss``, the default) or else ``pad_token_id``, as MindSpeed MM does.

    A batch in which no sample has an image or a video gets ``filler`` (one small image's tokens and pixels)
    appended to its first sample, with attention mask 0 and labels -100, as MindSpeed MM's collator does: every
    rank then runs the vision tower, so the sharded vision blocks' collectives happen on all ranks (a rank that
    skipped them would leave the others waiting), and the filler changes no loss (its tokens are masked and come
    after the text).
    ``pad_to_multiple_of`` rounds the padded width up to a multiple (MindSpeed MM's FSDP collator, 8 there).
    """

    def __init__(
        self,
        pad_token_id: int,
        ignore_pad_token_for_loss: bool = True,
        filler: dict[str, torch.Tensor] | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        self.filler = filler
        self.multiple = pad_to_multiple_of
        self.pad = {
            "input_ids": pad_token_id,
            "attention_mask": 0,
            "mm_token_type_ids": 0,
            "token_type_ids": 0,
            "labels": IGNORE_INDEX if ignore_pad_token_for_loss else pad_token_id,
        }

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.filler is not None and not any("pixel_values" in s or "pixel_values_videos" in s for s in samples):
            samples = [self._with_filler(samples[0]), *samples[1:]]
        keys = set().union(*(s.keys() for s in samples))
        unknown = keys - set(TOKEN_KEYS) - set(VISION_KEYS)
        if unknown:
            raise DataError(f"samples have keys the collate function does not know how to batch: {sorted(unknown)}")
        width = max(len(s["input_ids"]) for s in samples)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        batch: dict[str, torch.Tensor] = {}
        for key in TOKEN_KEYS:
            if key not in keys:
                continue
            out = torch.full((len(samples), width), self.pad[key], dtype=torch.long)
            for i, sample in enumerate(samples):
                value = sample[key]
                out[i, : len(value)] = value
            batch[key] = out
        for key in VISION_KEYS:
            parts = [s[key] for s in samples if key in s]
            if parts:
                batch[key] = _padded_cat(parts)
        return batch

    def _with_filler(self, sample: dict[str, Any]) -> dict[str, Any]:
        assert self.filler is not None
        extra = len(self.filler["input_ids"])
        out = dict(sample)
        out["input_ids"] = torch.cat([sample["input_ids"], self.filler["input_ids"]])
        out["attention_mask"] = torch.cat([sample["attention_mask"], torch.zeros(extra, dtype=torch.long)])
        out["labels"] = torch.cat([sample["labels"], torch.full((extra,), IGNORE_INDEX, dtype=torch.long)])
        for key in ("mm_token_type_ids", "token_type_ids"):
            if key in sample and key in self.filler:
                out[key] = torch.cat([sample[key], self.filler[key]])
        for key in VISION_KEYS:
            if key in self.filler:
                out[key] = self.filler[key]
        return out


def _padded_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if len({p.shape[1:] for p in parts}) == 1:
        return torch.cat(parts, dim=0)
    if len({p.ndim for p in parts}) != 1:
        raise DataError(f"samples' vision tensors have different ranks: {[tuple(p.shape) for p in parts]}")
    size = [max(p.shape[d] for p in parts) for d in range(1, parts[0].ndim)]
    out = parts[0].new_zeros((sum(p.shape[0] for p in parts), *size))
    row = 0
    for p in parts:
        region = (slice(row, row + p.shape[0]), *(slice(0, n) for n in p.shape[1:]))
        out[region] = p
        row += p.shape[0]
    return out
