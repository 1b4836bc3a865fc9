"""LLaVA (``LlavaForConditionalGeneration``: a CLIP/SigLIP-style vision tower, a projector and a decoder LM).

Default plan (derived from the model's metadata, :mod:`lightning_mm.hf.default_plans`): the vision tower's encoder
layers and its ``embeddings``, ``model.language_model.layers.{*}``, the embeddings, ``model.multi_modal_projector``
and ``lm_head``; with the vision tower frozen, ``model.vision_tower`` is ignored instead."""

from transformers import LlavaForConditionalGeneration

from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin

__all__ = ["MMLlavaForConditionalGeneration"]


class MMLlavaForConditionalGeneration(LlavaForConditionalGeneration, FSDP2Mixin, WeightInitMixin):
    """``transformers.LlavaForConditionalGeneration``, FSDP2-ready."""

    hub_keys = ("LlavaForConditionalGeneration", "llava")
