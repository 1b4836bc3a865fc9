"""LLaVA (``LlavaForConditionalGeneration``: a CLIP/SigLIP-style vision tower, a projector and a decoder LM).

Default plan: the vision tower's encoder layers and its ``embeddings``, ``model.language_model.layers.{*}``, the
embeddings, ``model.multi_modal_projector`` and ``lm_head``; with the vision tower frozen, ``model.vision_tower``
is ignored instead.
"""

from transformers import LlavaForConditionalGeneration

from lightning_mm.modules.hub import ModelHub
from lightning_mm.modules.mixins import FSDP2Mixin, WeightInitMixin

__all__ = ["MMLlavaForConditionalGeneration"]


@ModelHub.register("LlavaForConditionalGeneration", "llava")
class MMLlavaForConditionalGeneration(LlavaForConditionalGeneration, FSDP2Mixin, WeightInitMixin):
    """``transformers.LlavaForConditionalGeneration``, FSDP2-ready."""

    fsdp2_vision_towers = ("model.vision_tower",)
