"""Adapters registered in :class:`~lightning_mm.modules.ModelHub` out of the box.

Each is the Transformers class plus ``FSDP2Mixin`` and ``WeightInitMixin`` (the seed's recipe), registered under
its architecture name and its ``model_type``. Their default sharding plan (no ``sub_modules_to_wrap`` needed in
the YAML) wraps every decoder layer and vision block and the embeddings, and ignores a frozen vision tower.
"""

from lightning_mm.modules.adapters.causal_lm import MMLlamaForCausalLM, MMQwen2ForCausalLM, MMQwen3ForCausalLM
from lightning_mm.modules.adapters.internvl import MMInternVLForConditionalGeneration
from lightning_mm.modules.adapters.llava import MMLlavaForConditionalGeneration
from lightning_mm.modules.adapters.moe import MMQwen3MoeForCausalLM, MMQwen3VLMoeForConditionalGeneration
from lightning_mm.modules.adapters.qwen2_5_vl import MMQwen2_5_VLForConditionalGeneration

__all__ = [
    "MMLlamaForCausalLM",
    "MMQwen2ForCausalLM",
    "MMQwen3ForCausalLM",
    "MMInternVLForConditionalGeneration",
    "MMQwen2_5_VLForConditionalGeneration",
    "MMLlavaForConditionalGeneration",
    "MMQwen3MoeForCausalLM",
    "MMQwen3VLMoeForConditionalGeneration",
]
