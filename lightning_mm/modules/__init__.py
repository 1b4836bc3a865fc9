"""Model-side building blocks: the LightningModule with the seed's hooks and the seed's model mixins.

Importing this package (which every model-side import does first: ``TransformersModel``, the mixins, ...) registers
the Hugging Face checkpoint record (``hf``: architecture and config of each Transformers model, what ``dcp-to-hf``
reads) with the checkpoint package's record providers.
"""

from lightning_mm.checkpoint import register_record_provider
from lightning_mm.hf.hub import ModelHub, ModelHubError
from lightning_mm.hf.lora import LoRAConfig, LoRAConfigError, apply_lora  # PEFT is imported only on use
from lightning_mm.hf.mixins import FSDP2Mixin, MultiModalModule, WeightInitMixin
from lightning_mm.hf.records import hf_records
from lightning_mm.hf.transformers_model import TransformersModel, TransformersModelConfigError
from lightning_mm.modules.lightning_module import MMLightningModule

register_record_provider("hf", hf_records)

__all__ = ["MMLightningModule", "MultiModalModule", "FSDP2Mixin", "WeightInitMixin"]
__all__ += ["ModelHub", "ModelHubError", "TransformersModel", "TransformersModelConfigError"]
__all__ += ["LoRAConfig", "LoRAConfigError", "apply_lora"]
