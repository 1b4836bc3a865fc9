"""A tiny random dense Qwen3-VL (the real Transformers class, fp32) and batches built as its processor builds them.

Each sample holds two images of different grids, as Qwen3-VL's processor lays them out: ``<vision_start>``, one
``<image>`` token per merged 2x2 group of 14-pixel patches (``prod(image_grid_thw) / spatial_merge_size**2``),
``<vision_end>``; ``pixel_values`` are the flattened patches (``3 * temporal_patch_size * 14 * 14`` values each),
``mm_token_type_ids`` marks the image tokens (1) for the M-RoPE positions, and image tokens carry no label.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.scenarios.hf_scenarios import _TEXT, IMAGE_TOKEN, VOCAB

ARCH = "Qwen3VLForConditionalGeneration"
VISION_START, VISION_END, VIDEO_TOKEN = 7, 8, 6
PATCH = 3 * 2 * 14 * 14  # channels x temporal_patch_size x patch x patch
MERGE = 2
GRIDS = ((1, 4, 4), (1, 2, 4))  # a 56x56 image (4 tokens) and a 28x56 one (2 tokens)
SEQ = 24

CONFIG: dict[str, Any] = dict(
    text_config={
        **{k: v for k, v in _TEXT.items() if k not in ("bos_token_id", "eos_token_id")},
        "head_dim": 8,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
            "mrope_interleaved": True,
        },
    },
    vision_config=dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=32,
        patch_size=14,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    ),
    image_token_id=IMAGE_TOKEN,
    video_token_id=VIDEO_TOKEN,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
    tie_word_embeddings=False,
)
RECOMPUTE = ["model.visual.blocks.{*}", "model.language_model.layers.{*}"]


def hf_config() -> Any:
    import transformers

    config = transformers.Qwen3VLConfig(**CONFIG)
    config.architectures = [ARCH]
    return config


def tiny_qwen3_vl(seed: int = 0) -> torch.nn.Module:
    """The plain Transformers model, randomly initialised from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    return transformers.Qwen3VLForConditionalGeneration(hf_config()).eval()


def save_qwen3_vl(directory: Path, seed: int = 7) -> Path:
    """``save_pretrained`` the tiny model into ``directory`` (several files, with an index, as large ones are)."""
    tiny_qwen3_vl(seed).save_pretrained(directory, max_shard_size="60KB")
    return Path(directory)


def image_tokens(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w // MERGE**2


class Qwen3VLData(torch.utils.data.Dataset):
    """``n`` fixed samples, each with the images of ``GRIDS`` placed in its text at a sample-dependent offset."""

    def __init__(self, n: int = 4) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + i)
        ids = torch.randint(10, VOCAB, (SEQ,), generator=g)
        at = 1 + i % 3
        for grid in GRIDS:
            n = image_tokens(grid)
            ids[at], ids[at + 1 : at + 1 + n], ids[at + 1 + n] = VISION_START, IMAGE_TOKEN, VISION_END
            at += n + 3
        labels = ids.clone()
        labels[ids == IMAGE_TOKEN] = -100
        patches = sum(t * h * w for t, h, w in GRIDS)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": labels,
            "pixel_values": torch.randn(patches, PATCH, generator=g),
            "image_grid_thw": torch.tensor(GRIDS),
            "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
        }


def tiny_model_provider() -> torch.nn.Module:
    """A ``model_provider`` for LightningCLI configs: the adapter built from :data:`CONFIG` alone."""
    from lightning_mm.modules import TransformersModel

    return TransformersModel({"hf_config": {"model_type": "qwen3_vl", **CONFIG}})


def datasets_provider(*_: Any) -> tuple[Qwen3VLData, None, None]:
    """A ``train_valid_test_datasets_provider`` for LightningCLI configs."""
    return Qwen3VLData(), None, None
