"""Llama-family causal language models: Llama, Qwen2, Qwen3.

Default plan: ``model.layers.{*}``, ``model.embed_tokens`` and ``lm_head`` (one unit when tied).
"""

from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from lightning_mm.modules.hub import ModelHub
from lightning_mm.modules.mixins import FSDP2Mixin, WeightInitMixin

__all__ = ["MMLlamaForCausalLM", "MMQwen2ForCausalLM", "MMQwen3ForCausalLM"]


@ModelHub.register("LlamaForCausalLM", "llama")
class MMLlamaForCausalLM(LlamaForCausalLM, FSDP2Mixin, WeightInitMixin):
    """``transformers.LlamaForCausalLM``, FSDP2-ready."""


@ModelHub.register("Qwen2ForCausalLM", "qwen2")
class MMQwen2ForCausalLM(Qwen2ForCausalLM, FSDP2Mixin, WeightInitMixin):
    """``transformers.Qwen2ForCausalLM``, FSDP2-ready."""


@ModelHub.register("Qwen3ForCausalLM", "qwen3")
class MMQwen3ForCausalLM(Qwen3ForCausalLM, FSDP2Mixin, WeightInitMixin):
    """``transformers.Qwen3ForCausalLM``, FSDP2-ready."""
