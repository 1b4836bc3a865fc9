"""Tiny random models of the layer kinds packing must keep exact (tests/test_packing.py), real Transformers classes.

* ``mistral_sliding``: Mistral with a 4-token sliding window (shorter than the samples, so the window is active);
* ``qwen3_moe``: Qwen3-MoE, 4 experts, 2 per token, with its load-balancing loss in the loss;
* ``qwen3_5``: Qwen3.5 (``Qwen3_5ForConditionalGeneration``): a Gated DeltaNet (linear attention, with its causal
  convolution) layer and a full-attention layer, the tiny Qwen3-VL's vision tower and token ids;
* ``qwen3_5_moe``: Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``): the same with MoE MLPs;
* ``qwen3_next``: Qwen3-Next (text): Gated DeltaNet and full attention, MoE MLPs.

``initializer_range`` 0.3 makes the carried state large enough that a leak across samples shows at fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.helpers.qwen3_vl_family import CONFIG as QWEN3_VL
from tests.scenarios.hf_scenarios import _TEXT

__all__ = ["FAMILIES", "tiny_packing_model"]

_LINEAR = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
    initializer_range=0.3,
)


def _qwen3_5() -> Any:
    import transformers

    text = {**QWEN3_VL["text_config"], **_LINEAR}
    text["rope_parameters"] = {**text["rope_parameters"], "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0]}
    vision = {k: v for k, v in QWEN3_VL["vision_config"].items() if k != "deepstack_visual_indexes"}
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")
    return transformers.Qwen3_5Config(text_config=text, vision_config=vision, **{k: QWEN3_VL[k] for k in tokens})


def _qwen3_5_moe() -> Any:
    import transformers

    dense = _qwen3_5()
    text = {**dense.text_config.to_dict(), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    text["shared_expert_intermediate_size"] = 16
    for key in ("model_type", "architectures", "intermediate_size"):
        text.pop(key, None)
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")
    vision = {k: v for k, v in QWEN3_VL["vision_config"].items() if k != "deepstack_visual_indexes"}
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **{k: QWEN3_VL[k] for k in tokens})


def _configs() -> dict[str, tuple[str, Any]]:
    import transformers

    return {
        "mistral_sliding": (
            "MistralForCausalLM",
            transformers.MistralConfig(**_TEXT, head_dim=8, sliding_window=4, tie_word_embeddings=False),
        ),
        "qwen3_moe": (
            "Qwen3MoeForCausalLM",
            transformers.Qwen3MoeConfig(  # with the load-balancing loss: it averages over the real tokens
                **_TEXT,
                head_dim=8,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                output_router_logits=True,
                router_aux_loss_coef=0.5,
            ),
        ),
        "qwen3_5": ("Qwen3_5ForConditionalGeneration", _qwen3_5()),
        "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", _qwen3_5_moe()),
        "qwen3_next": (
            "Qwen3NextForCausalLM",
            transformers.Qwen3NextConfig(
                **_TEXT, **_LINEAR, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
            ),
        ),
    }


FAMILIES = ("mistral_sliding", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")


def tiny_packing_model(family: str, seed: int = 0) -> nn.Module:
    """The plain Transformers model of ``family`` (:data:`FAMILIES`), randomly initialised from ``seed``."""
    import transformers

    arch, config = _configs()[family]
    config.architectures = [arch]
    torch.manual_seed(seed)
    return getattr(transformers, arch)(config).eval()
