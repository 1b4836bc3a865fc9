"""Model-side building blocks: the LightningModule with the seed's hooks and the seed's model mixins."""

from lightning_mm.modules.hub import ModelHub, ModelHubError
from lightning_mm.modules.lightning_module import MMLightningModule
from lightning_mm.modules.lora import LoRAConfig, LoRAConfigError, apply_lora  # PEFT is imported only on use
from lightning_mm.modules.mixins import FSDP2Mixin, MultiModalModule, WeightInitMixin
from lightning_mm.modules.transformers_model import TransformersModel, TransformersModelConfigError

__all__ = ["MMLightningModule", "MultiModalModule", "FSDP2Mixin", "WeightInitMixin"]
__all__ += ["ModelHub", "ModelHubError", "TransformersModel", "TransformersModelConfigError"]
__all__ += ["LoRAConfig", "LoRAConfigError", "apply_lora"]
