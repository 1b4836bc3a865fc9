"""Model-side building blocks: the LightningModule with the seed's hooks and the seed's model mixins."""

from lightning_mm.modules.lightning_module import MMLightningModule
from lightning_mm.modules.mixins import FSDP2Mixin, MultiModalModule, WeightInitMixin

__all__ = ["MMLightningModule", "MultiModalModule", "FSDP2Mixin", "WeightInitMixin"]
