"""Mixture-of-experts models: Qwen3-MoE and Qwen3-VL-MoE.

Default plan (derived from the model's metadata, :mod:`lightning_mm.hf.default_plans`): as for their dense
relatives (decoder layers, vision blocks, embeddings; Qwen3-VL-MoE's vision units are dense Qwen3-VL's: the patch
and position embeddings, the merger and each DeepStack merger), plus
``moe_modules``: every decoder layer's ``mlp.experts`` (Transformers 5's fused 3-D expert weights), which
``expert_parallel_size`` > 1 splits over the ranks of an EP group. Their expert modules share Transformers' call
shape ``experts(hidden_states, top_k_index, top_k_weights)``, so the strategy's routed forward
(:mod:`lightning_mm.core.expert_parallel`) dispatches them without model code.
"""

from transformers import Qwen3MoeForCausalLM, Qwen3VLMoeForConditionalGeneration

from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin

__all__ = ["MMQwen3MoeForCausalLM", "MMQwen3VLMoeForConditionalGeneration"]


class MMQwen3MoeForCausalLM(Qwen3MoeForCausalLM, FSDP2Mixin, WeightInitMixin):
    """``transformers.Qwen3MoeForCausalLM``, FSDP2- and expert-parallel-ready."""

    hub_keys = ("Qwen3MoeForCausalLM", "qwen3_moe")


class MMQwen3VLMoeForConditionalGeneration(Qwen3VLMoeForConditionalGeneration, FSDP2Mixin, WeightInitMixin):
    """``transformers.Qwen3VLMoeForConditionalGeneration``, FSDP2- and expert-parallel-ready."""

    hub_keys = ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe")
