"""Tiny random models of architectures that have no hand-written adapter (real Transformers classes, fp32, built
locally), and batches for two of them as their models take them.

``ARCHITECTURES``: Gemma 3, Idefics3 (SmolVLM), Mistral 3 (Pixtral vision), GLM-4.1V, GLM-4.5V (MoE) and the
Qwen2.5-Omni thinker (vision and audio towers). ``PARITY``: the two the 2-rank parity run trains
(``tests/scenarios/derive_scenarios.py``): Idefics3 (one 28x28 image per sample: 2x2 patches, pixel shuffle by 2 -> one
``<image>`` token) and Mistral 3 (one 28x28 image: 2x2 Pixtral patches, spatial merge 2 -> one token, with its
``image_sizes``). Image tokens carry no label.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.scenarios.hf_scenarios import _TEXT, IMAGE_TOKEN, SEQ, VOCAB

_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_QWEN_LIKE_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    out_hidden_size=32,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}

# name -> (architecture, config kwargs)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": (
        "Gemma3ForConditionalGeneration",
        dict(
            text_config={**_TEXT, "head_dim": 8, "sliding_window": 8},
            vision_config={**_VISION, "image_size": 28, "patch_size": 14, "vision_use_head": False},
            mm_tokens_per_image=1,
            image_token_id=IMAGE_TOKEN,
            boi_token_id=6,
            eoi_token_id=7,
        ),
    ),
    "idefics3": (
        "Idefics3ForConditionalGeneration",
        dict(
            text_config={**_TEXT, "model_type": "llama", "tie_word_embeddings": False},
            vision_config={**_VISION, "image_size": 28, "patch_size": 14},
            scale_factor=2,
            image_token_id=IMAGE_TOKEN,
            tie_word_embeddings=False,
        ),
    ),
    "mistral3": (
        "Mistral3ForConditionalGeneration",
        dict(
            text_config={**_TEXT, "model_type": "mistral", "head_dim": 8, "sliding_window": None},
            vision_config={**_VISION, "model_type": "pixtral", "image_size": 28, "patch_size": 14, "head_dim": 8},
            spatial_merge_size=2,
            image_token_id=IMAGE_TOKEN,
            tie_word_embeddings=False,
        ),
    ),
    "glm4v": (
        "Glm4vForConditionalGeneration",
        dict(
            text_config={**_TEXT, "rope_parameters": _MROPE},
            vision_config={**_QWEN_LIKE_VISION, "image_size": 28},
            image_token_id=IMAGE_TOKEN,
            video_token_id=6,
            image_start_token_id=7,
            image_end_token_id=8,
        ),
    ),
    "glm4v_moe": (
        "Glm4vMoeForConditionalGeneration",
        dict(
            text_config={
                **_TEXT,
                "head_dim": 8,
                "moe_intermediate_size": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
                "rope_parameters": {**_MROPE, "partial_rotary_factor": 0.5},
            },
            vision_config={**_QWEN_LIKE_VISION, "image_size": 28},
            image_token_id=IMAGE_TOKEN,
            video_token_id=6,
            image_start_token_id=7,
            image_end_token_id=8,
        ),
    ),
    "qwen2_5_omni_thinker": (
        "Qwen2_5OmniThinkerForConditionalGeneration",
        dict(
            text_config={**_TEXT, "rope_parameters": _MROPE},
            vision_config={
                **{k: v for k, v in _QWEN_LIKE_VISION.items() if k != "patch_size"},
                "fullatt_block_indexes": [1],
            },
            audio_config=dict(
                d_model=32,
                encoder_layers=2,
                encoder_attention_heads=4,
                encoder_ffn_dim=64,
                output_dim=32,
                num_mel_bins=16,
            ),
        ),
    ),
}
PARITY = ("idefics3", "mistral3")


def hf_config(name: str) -> Any:
    import transformers

    arch, kwargs = ARCHITECTURES[name]
    config = getattr(transformers, arch).config_class(**kwargs)
    config.architectures = [arch]
    return config


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The plain Transformers model, randomly initialised from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, ARCHITECTURES[name][0])(hf_config(name)).float().eval()


def save_tiny(directory: Path, names: tuple[str, ...] | list[str], original_format: bool = True) -> dict[str, Path]:
    """``save_pretrained`` each model into ``directory/<name>`` (Transformers' default: the original key layout)."""
    out = {}
    for i, name in enumerate(names):
        out[name] = Path(directory) / name
        tiny_model(name, seed=20 + i).save_pretrained(out[name], save_original_format=original_format)
    return out


class DeriveData(torch.utils.data.Dataset):
    """``n`` fixed samples of one ``PARITY`` architecture: token ids with one image and its token."""

    def __init__(self, name: str, n: int) -> None:
        assert name in PARITY, name
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3000 + i)
        ids = torch.randint(10, VOCAB, (SEQ,), generator=g)
        ids[1] = IMAGE_TOKEN
        labels = ids.clone()
        labels[ids == IMAGE_TOKEN] = -100
        image = torch.randn(3, 28, 28, generator=g)
        sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        if self.name == "idefics3":
            sample["pixel_values"] = image[None]  # (images per sample, C, H, W)
        else:
            sample.update(pixel_values=image, image_sizes=torch.tensor([28, 28]))
        return sample


def register_parity_families() -> None:
    """Make the ``PARITY`` architectures known to the parity harness (``tests/helpers/parity.py``'s ``EXTRA``)."""
    from functools import partial

    from tests.helpers import parity

    for name in PARITY:
        parity.EXTRA[name] = (ARCHITECTURES[name][0], partial(DeriveData, name))


def gemma3_provider() -> torch.nn.Module:
    """A ``model_provider`` for LightningCLI configs: tiny Gemma 3 from ``hf_config`` alone (its ``model_type``, no
    ``architectures``: the class comes from Transformers' auto mappings), random init."""
    from lightning_mm.modules import TransformersModel

    return TransformersModel({"hf_config": {"model_type": "gemma3", **ARCHITECTURES["gemma3"][1]}})
