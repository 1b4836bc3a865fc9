"""Tiny random Qwen3-MoE and Qwen3-VL-MoE models (real Transformers classes, fp32) for the expert-parallel tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.scenarios.hf_scenarios import IMAGE_TOKEN, VOCAB

_MOE_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", _MOE_TEXT),
    "qwen3_vl_moe": (
        "Qwen3VLMoeForConditionalGeneration",
        dict(
            text_config={
                **{k: v for k, v in _MOE_TEXT.items() if k not in ("decoder_sparse_step", "mlp_only_layers")},
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
                spatial_merge_size=2,
                temporal_patch_size=2,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0],
            ),
            image_token_id=IMAGE_TOKEN,
            video_token_id=6,
            vision_start_token_id=7,
            vision_end_token_id=8,
            tie_word_embeddings=False,
        ),
    ),
}
MOE_MODULES = {
    "qwen3_moe": "model.layers.{*}.mlp.experts",
    "qwen3_vl_moe": "model.language_model.layers.{*}.mlp.experts",
}


def tiny_moe_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny model of ``family`` (same seed, same weights)."""
    import transformers

    arch, kwargs = MOE_FAMILIES[family]
    cls = getattr(transformers, arch)
    config = cls.config_class(**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = cls(config)
    return model.float().eval()


def register_moe_families() -> None:
    """Make the MoE families known to the parity harness (``tests/helpers/parity.py`` looks families up by name)."""
    from tests.scenarios.hf_scenarios import FAMILIES

    FAMILIES.update(MOE_FAMILIES)


def save_moe_checkpoints(directory: Path) -> dict[str, Path]:
    """``save_pretrained`` each MoE family's tiny model into ``directory/<family>``.

    Qwen3-VL-MoE in its original layout (fused experts with their last two dimensions swapped, which sliced loading
    transposes); Qwen3-MoE in Transformers 5's own fused layout (its original per-expert Hub layout is covered by
    ``tests/scenarios/ep_custom_scenarios.py`` and ``tests/test_hub_expert_layout.py``).
    """
    out = {}
    for i, family in enumerate(MOE_FAMILIES):
        out[family] = Path(directory) / family
        original = family == "qwen3_vl_moe"
        tiny_moe_model(family, seed=10 + i).save_pretrained(out[family], save_original_format=original)
    return out
