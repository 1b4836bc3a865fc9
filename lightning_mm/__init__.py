"""lightning-mm: MindSpeed MM's FSDP2 training workflow for PyTorch Lightning.

Importing the package registers ``strategy="mm_fsdp2"``, ``strategy="single_npu"`` and ``accelerator="npu"`` with
Lightning's registries; nothing else in Lightning or torch changes, and torch_npu is not imported.
"""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_mm.accelerators import NPUAccelerator, SingleNPUStrategy
from lightning_mm.datamodules import MMDataModule
from lightning_mm.modules import MMLightningModule
from lightning_mm.strategies import FSDP2Config, MMFSDP2Strategy

__version__ = "0.1.0"
__all__ = ["MMFSDP2Strategy", "FSDP2Config", "MMLightningModule", "MMDataModule", "NPUAccelerator",
           "SingleNPUStrategy", "__version__"]

MMFSDP2Strategy.register_strategies(StrategyRegistry)
SingleNPUStrategy.register_strategies(StrategyRegistry)
NPUAccelerator.register_accelerators(AcceleratorRegistry)
