"""Llama-family causal language models: Llama, Qwen2, Qwen3.

Default plan (derived from the model's metadata, :mod:`lightning_mm.hf.default_plans`): ``model.layers.{*}``,
``model.embed_tokens`` and ``lm_head`` (one unit when tied)."""

from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin

__all__ = ["MMLlamaForCausalLM", "MMQwen2ForCausalLM", "MMQwen3ForCausalLM"]


class MMLlamaForCausalLM(LlamaForCausalLM, FSDP2Mixin, WeightInitMixin):
    """``transformers.LlamaForCausalLM``, FSDP2-ready."""

    hub_keys = ("LlamaForCausalLM", "llama")


class MMQwen2ForCausalLM(Qwen2ForCausalLM, FSDP2Mixin, WeightInitMixin):
    """``transformers.Qwen2ForCausalLM``, FSDP2-ready."""

    hub_keys = ("Qwen2ForCausalLM", "qwen2")


class MMQwen3ForCausalLM(Qwen3ForCausalLM, FSDP2Mixin, WeightInitMixin):
    """``transformers.Qwen3ForCausalLM``, FSDP2-ready."""

    hub_keys = ("Qwen3ForCausalLM", "qwen3")
