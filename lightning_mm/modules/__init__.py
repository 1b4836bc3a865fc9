"""Model-side building blocks: the LightningModule with MindSpeed MM's hooks and MindSpeed MM's model mixins.

The model API itself (hub, mixins, ``TransformersModel``, LoRA) lives in :mod:`lightning_mm.hf`; this is its face.
"""

from lightning_mm.hf.lora import LoRAConfig, LoRAConfigError, apply_lora  # PEFT is imported only on use
from lightning_mm.hf.mixins import FSDP2Mixin, MultiModalModule, WeightInitMixin
from lightning_mm.hf.model_hub import ModelHub, ModelHubError
from lightning_mm.hf.transformers_model import TransformersModel, TransformersModelConfigError
from lightning_mm.modules.lightning_module import MMLightningModule

__all__ = ["MMLightningModule", "MultiModalModule", "FSDP2Mixin", "WeightInitMixin"]
__all__ += ["ModelHub", "ModelHubError", "TransformersModel", "TransformersModelConfigError"]
__all__ += ["LoRAConfig", "LoRAConfigError", "apply_lora"]
