"""Tiny random Qwen3.5 models (Transformers' own classes, saved locally): the stand-ins of MindSpeed MM's Qwen3.5
native configs. Qwen3.5 mixes gated-delta-net layers (``linear_attn``) with full-attention layers (``self_attn``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_qwen3_5_moe(directory: Path, num_experts: int = 8, seed: int = 5) -> Path:
    """A tiny Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``) directory: 4 text layers, linear, linear, linear,
    full attention (the 122B's period), ``num_experts`` experts in each MoE block, a 2-block vision tower."""
    import torch
    import transformers

    text: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=num_experts,
        num_experts_per_tok=2,
        initializer_range=0.3,
    )
    vision: dict[str, Any] = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=32,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
    )
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    torch.manual_seed(seed)
    transformers.Qwen3_5MoeForConditionalGeneration(config).save_pretrained(directory)
    return directory
