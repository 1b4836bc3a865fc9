"""Adapters registered in :class:`~lightning_mm.modules.ModelHub` out of the box.

Each is the Transformers class plus ``FSDP2Mixin`` and ``WeightInitMixin`` (MindSpeed MM's recipe); its ``hub_keys``
(architecture name and ``model_type``) are the keys :class:`~lightning_mm.hf.model_hub.ModelHub` registers it under on
first lookup (``BUILTIN_ADAPTERS``; the adapters do not import the hub). Their default sharding plan (no
``sub_modules_to_wrap`` needed in the YAML) is derived from the model's own metadata like any Transformers
model's (:func:`lightning_mm.hf.default_plans.derive_fsdp2_plan`): every decoder layer and vision block, the
embeddings, the projector, and a frozen vision tower ignored. An architecture without an adapter here gets the
same derivation through :func:`lightning_mm.hf.derived_adapters.derived_adapter`.
"""

from lightning_mm.hf.adapters.causal_lm import MMLlamaForCausalLM, MMQwen2ForCausalLM, MMQwen3ForCausalLM
from lightning_mm.hf.adapters.internvl import MMInternVLForConditionalGeneration
from lightning_mm.hf.adapters.llava import MMLlavaForConditionalGeneration
from lightning_mm.hf.adapters.moe import MMQwen3MoeForCausalLM, MMQwen3VLMoeForConditionalGeneration
from lightning_mm.hf.adapters.qwen2_5_vl import MMQwen2_5_VLForConditionalGeneration
from lightning_mm.hf.adapters.qwen3_vl import MMQwen3VLForConditionalGeneration

__all__ = [
    "BUILTIN_ADAPTERS",
    "MMLlamaForCausalLM",
    "MMQwen2ForCausalLM",
    "MMQwen3ForCausalLM",
    "MMInternVLForConditionalGeneration",
    "MMQwen2_5_VLForConditionalGeneration",
    "MMQwen3VLForConditionalGeneration",
    "MMLlavaForConditionalGeneration",
    "MMQwen3MoeForCausalLM",
    "MMQwen3VLMoeForConditionalGeneration",
]

BUILTIN_ADAPTERS: tuple[type, ...] = (
    MMLlamaForCausalLM,
    MMQwen2ForCausalLM,
    MMQwen3ForCausalLM,
    MMInternVLForConditionalGeneration,
    MMQwen2_5_VLForConditionalGeneration,
    MMLlavaForConditionalGeneration,
    MMQwen3MoeForCausalLM,
    MMQwen3VLMoeForConditionalGeneration,
    MMQwen3VLForConditionalGeneration,
)
