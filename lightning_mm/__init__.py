"""lightning-mm: MindSpeed MM's FSDP2 training workflow for PyTorch Lightning.

Every ``import lightning_mm`` (also ``from lightning_mm import ...`` and ``import lightning_mm.<anything>``, which
run this file first), however Python was started (a script, ``python -m``, ``python -c``, the ``lightning-mm``
command), makes ``strategy="mm_fsdp2"``, ``strategy="single_npu"`` and ``accelerator="npu"`` known to Lightning's
registries. Nothing else in Lightning or torch changes; torch_npu is not imported.

Importing this package does not import Lightning: the names are registered the moment Lightning itself is imported
(at once if it already is). Lightning offers no entry point for strategy or accelerator names, so this uses Python's
import machinery (``lightning_mm/_utils/import_watch.py``): right after ``lightning.pytorch`` (with ``lightning``) has
been imported, and before any code can ask the registries, ``lightning_mm.strategies`` and ``lightning_mm.accelerators``
are imported and register their classes. A process that never imports Lightning (``lightning-mm --help``,
``migrate``, ``convert``, ``env``, or one that uses only ``lightning_mm.core``) therefore never imports Lightning or
Transformers either, and one that does always finds the names.

The public classes below are imported on first use (``lightning_mm.MMFSDP2Strategy``); :func:`register` imports
them all and registers the names at once (importing Lightning).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_mm._utils.import_watch import call_once_imported

__version__ = "0.1.0"
__all__ = [
    "MMFSDP2Strategy",
    "FSDP2Config",
    "MMLightningModule",
    "MMDataModule",
    "NPUAccelerator",
    "SingleNPUStrategy",
    "register",
    "__version__",
]

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


def _register_names() -> None:
    """Register ``mm_fsdp2``, ``single_npu`` and ``npu`` with Lightning's registries (idempotent)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mm.accelerators import NPUAccelerator, SingleNPUStrategy
    from lightning_mm.strategies import MMFSDP2Strategy

    MMFSDP2Strategy.register_strategies(StrategyRegistry)
    SingleNPUStrategy.register_strategies(StrategyRegistry)
    NPUAccelerator.register_accelerators(AcceleratorRegistry)  # torch_npu stays unimported


def register() -> None:
    """Import the public classes and register ``mm_fsdp2``, ``single_npu`` and ``npu`` with Lightning now.

    Idempotent. Not needed after ``import lightning_mm`` (the names are registered as Lightning is imported); it
    makes the import of Lightning and of the public classes happen here rather than on first use.
    """
    for name, home in _HOMES.items():
        globals()[name] = getattr(importlib.import_module(home), name)
    _register_names()


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_mm' has no attribute {name!r}")


# Watched besides Lightning: this package's own modules, since one of them (lightning_mm.strategies, say) may be
# what imports Lightning; registering waits until it has finished importing.
call_once_imported("lightning.pytorch", _register_names, also_wait_for=("lightning_mm.",))
