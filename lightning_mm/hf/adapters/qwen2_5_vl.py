"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``).

Default plan (derived from the model's metadata, :mod:`lightning_mm.hf.default_plans`): ``model.visual.blocks.{*}``,
``model.visual.patch_embed``, the patch merger ``model.visual.merger`` (the projector into the language model),
``model.language_model.layers.{*}``, the embeddings and ``lm_head``; with the vision tower frozen, ``model.visual``
is ignored instead."""

from transformers import Qwen2_5_VLForConditionalGeneration

from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin

__all__ = ["MMQwen2_5_VLForConditionalGeneration"]


class MMQwen2_5_VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration, FSDP2Mixin, WeightInitMixin):
    """``transformers.Qwen2_5_VLForConditionalGeneration``, FSDP2-ready."""

    hub_keys = ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl")
