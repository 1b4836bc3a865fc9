"""lightning-mm: MindSpeed MM's FSDP2 training workflow for PyTorch Lightning.

``import lightning_mm`` imports the classes below and registers ``strategy="mm_fsdp2"``,
``strategy="single_npu"`` and ``accelerator="npu"`` with Lightning's registries (nothing else in Lightning or torch
changes; torch_npu is not imported). The one exception is the ``lightning-mm`` command itself: there the package
starts empty (the names below are still importable, on first use), so that commands that do not train
(``--help``, ``migrate``, ``convert``, ``env``) never import Lightning or Transformers;
the training commands call :func:`register`.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["MMFSDP2Strategy", "FSDP2Config", "MMLightningModule", "MMDataModule", "NPUAccelerator",
           "SingleNPUStrategy", "register", "__version__"]

_HOMES = {
    "MMFSDP2Strategy": "lightning_mm.strategies",
    "FSDP2Config": "lightning_mm.strategies",
    "MMLightningModule": "lightning_mm.modules",
    "MMDataModule": "lightning_mm.datamodules",
    "NPUAccelerator": "lightning_mm.accelerators",
    "SingleNPUStrategy": "lightning_mm.accelerators",
}

if TYPE_CHECKING:
    from lightning_mm.accelerators import NPUAccelerator, SingleNPUStrategy
    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.modules import MMLightningModule
    from lightning_mm.strategies import FSDP2Config, MMFSDP2Strategy


def register() -> None:
    """Import the public classes and register ``mm_fsdp2``, ``single_npu`` and ``npu`` with Lightning (idempotent)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    for name, home in _HOMES.items():
        globals()[name] = getattr(importlib.import_module(home), name)
    globals()["MMFSDP2Strategy"].register_strategies(StrategyRegistry)
    globals()["SingleNPUStrategy"].register_strategies(StrategyRegistry)
    globals()["NPUAccelerator"].register_accelerators(AcceleratorRegistry)  # torch_npu stays unimported


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        register()
        return globals()[name]
    raise AttributeError(f"module 'lightning_mm' has no attribute {name!r}")


def _started_as_the_command() -> bool:
    """True inside the ``lightning-mm`` console script or ``python -m lightning_mm.<module>``."""
    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or os.path.basename(first) in ("lightning-mm", "lightning-mm.exe")


if not _started_as_the_command():
    register()
