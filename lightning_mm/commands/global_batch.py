"""The global batch size of a migrated job, kept on any device or node count.

MindSpeed MM fixes ``--global-batch-size`` and derives the gradient accumulation from it (``global / (micro batch x
data-parallel ranks)``), so the same job run on more or fewer devices trains on the same batches per step.
``lightning-mm migrate`` writes :class:`GlobalBatchSize` with that number: at ``fit`` it recomputes
``trainer.accumulate_grad_batches`` for the world size the run really has (as Lightning's own
``GradientAccumulationScheduler`` sets it), or refuses before the first step, with the arithmetic, when the global
batch is not a multiple of micro batch x data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_mm._utils.global_batch_math import accumulation_for
from lightning_mm.errors import ConfigError

__all__ = ["GlobalBatchSize", "accumulation_for"]


class GlobalBatchSize(Callback):
    """Keep MindSpeed MM's ``--global-batch-size`` whatever the world size: ``accumulate_grad_batches`` is set from
    it at ``fit`` (see the module docstring)."""

    def __init__(self, global_batch_size: int) -> None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ConfigError(
                f"GlobalBatchSize: global_batch_size must be a positive integer, got {global_batch_size!r}"
            )
        self.global_batch_size = global_batch_size

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        datamodule: Any = getattr(trainer, "datamodule", None)
        if getattr(datamodule, "max_tokens_per_rank", None) is not None:
            raise ConfigError(
                f"GlobalBatchSize({self.global_batch_size}): the data module forms token-budget batches "
                "(max_tokens_per_rank), whose sample count varies; give trainer.accumulate_grad_batches instead"
            )
        micro = getattr(datamodule, "batch_size", None)
        if not isinstance(micro, int) or micro < 1:
            raise ConfigError(
                f"GlobalBatchSize({self.global_batch_size}): the data module has no batch_size to derive the "
                "accumulation from; give trainer.accumulate_grad_batches instead"
            )
        context_parallel = _context_parallel(trainer.strategy)
        accumulate = accumulation_for(self.global_batch_size, micro, trainer.world_size, context_parallel)
        if trainer.accumulate_grad_batches != accumulate:
            rank_zero_info(
                f"GlobalBatchSize: accumulate_grad_batches {trainer.accumulate_grad_batches} -> {accumulate}, to keep "
                f"the global batch size {self.global_batch_size} on {trainer.world_size} ranks "
                f"({micro} x {trainer.world_size // context_parallel} data-parallel ranks x {accumulate})"
            )
        trainer.accumulate_grad_batches = accumulate


def _context_parallel(strategy: Any) -> int:
    """The run's context-parallel size before the strategy is set up: its argument, else the ``context_parallel_size``
    of the FSDP2 config given to it (the key the argument is an alias of; the layout refuses two different sizes)."""
    size = int(getattr(strategy, "context_parallel_size", 1) or 1)
    if size == 1:
        size = int(getattr(getattr(strategy, "given_config", None), "context_parallel_size", 1) or 1)
    return size
