"""The collate function of :class:`~lightning_mm.hf.chat_samples.ChatSampleBuilder` samples (MindSpeed MM's
``DataCollatorForQwen2vl``): right padding, vision tensors concatenated as the Qwen-VL forward takes them."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ChatCollator", "TOKEN_KEYS", "VISION_KEYS"]

IGNORE_INDEX = -100
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")
"""Per-token keys: padded on the right to the longest sample."""
VISION_KEYS = ("pixel_values", "image_grid_thw")
"""Per-image keys: concatenated along their first dimension (Qwen-VL takes all patches of a batch as one tensor,
with one ``image_grid_thw`` row per image, in sample order)."""


class ChatCollator:
    """Pads ``input_ids`` with ``pad_token_id``, ``attention_mask`` and ``mm_token_type_ids`` with 0, and ``labels``
    with -100 (``ignore_pad_token_for_loss``, the default) or else ``pad_token_id``, as MindSpeed MM does."""

    def __init__(self, pad_token_id: int, ignore_pad_token_for_loss: bool = True) -> None:
        self.pad = {"input_ids": pad_token_id, "attention_mask": 0, "mm_token_type_ids": 0, "token_type_ids": 0,
                    "labels": IGNORE_INDEX if ignore_pad_token_for_loss else pad_token_id}

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        keys = set().union(*(s.keys() for s in samples))
        unknown = keys - set(TOKEN_KEYS) - set(VISION_KEYS)
        if unknown:
            raise ValueError(f"samples have keys the collate function does not know how to batch: {sorted(unknown)}")
        width = max(len(s["input_ids"]) for s in samples)
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
                batch[key] = torch.cat(parts, dim=0)
        return batch
