"""InternVL (Transformers' native implementation: ``InternVLForConditionalGeneration``), as MindSpeed MM's example.

Default plan (derived from the model's metadata, :mod:`lightning_mm.hf.default_plans`):
``model.vision_tower.encoder.layer.{*}``, ``model.vision_tower.embeddings``, ``model.language_model.layers.{*}``,
the embeddings, ``model.multi_modal_projector`` and ``lm_head`` (one unit when tied); with the vision tower frozen,
``model.vision_tower`` is ignored instead."""

from transformers import InternVLForConditionalGeneration

from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin

__all__ = ["MMInternVLForConditionalGeneration"]


class MMInternVLForConditionalGeneration(InternVLForConditionalGeneration, FSDP2Mixin, WeightInitMixin):
    """``transformers.InternVLForConditionalGeneration``, FSDP2-ready."""

    hub_keys = ("InternVLForConditionalGeneration", "internvl")
