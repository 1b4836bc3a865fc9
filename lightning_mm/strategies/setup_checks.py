"""What the strategy does around sharding at setup that is not sharding: callbacks refused before any process
group, ``Trainer(sync_batchnorm=True)``'s conversion, and the choice of torch's fused optimiser step."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_mm.core.optimizer import FusedSteps
from lightning_mm.errors import InputTypeError

__all__ = ["convert_sync_batchnorm", "refuse_unsupported_callbacks", "choose_fused_optimizer_steps"]


def refuse_unsupported_callbacks(trainer: Any) -> None:
    """Refuse, before any process group or epoch, the callbacks that cannot work on sharded parameters."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    swa = [type(c).__name__ for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]
    if swa:
        raise MisconfigurationException(
            f"MMFSDP2Strategy does not support the {swa[0]} callback: it averages a copy of the unsharded "
            "module into the sharded (DTensor) parameters, which fails once `swa_epoch_start` is reached. "
            "Remove the callback, or average the weights yourself, e.g. with torch.optim.swa_utils.AveragedModel "
            "over the sharded module after `fully_shard`."
        )


def convert_sync_batchnorm(layer_sync: Any, root: nn.Module, device: torch.device) -> None:
    """``Trainer(sync_batchnorm=True)``: convert the BatchNorm layers before sharding, as DDP and FSDP do."""
    converted = layer_sync.apply(root)
    if converted is not root:
        raise InputTypeError(
            f"{type(layer_sync).__name__} replaced the LightningModule itself; MMFSDP2Strategy can only convert "
            "layers inside it"
        )
    count = sum(isinstance(m, nn.SyncBatchNorm) for m in root.modules())
    rank_zero_info(f"Trainer(sync_batchnorm=True): {count} SyncBatchNorm layer(s), synchronised over all ranks")
    if count and device.type == "cpu":
        rank_zero_warn(
            f"Trainer(sync_batchnorm=True) on CPU: torch's SyncBatchNorm synchronises only on GPU/NPU-class "
            f"devices, so a training forward through the {count} converted layer(s) will fail on CPU "
            "(evaluation, which uses the running statistics, works)."
        )


def choose_fused_optimizer_steps(fused_steps: FusedSteps, optimizers: list[Optimizer]) -> None:
    """Torch's fused Adam/AdamW step for the parameter groups that left ``fused``/``foreach`` unset (applied by
    ``fused_steps`` during each step, never written into the groups); logged."""
    decisions = fused_steps.choose(optimizers)
    fused = [d for d in decisions if d.fused]
    if fused:
        rank_zero_info(
            f"Optimizer step: torch's fused Adam/AdamW for {len(fused)} parameter group(s) that left "
            "`fused`/`foreach` unset (MMFSDP2Strategy(fused_optimizer_step=False) keeps torch's choice)"
        )
    for d in decisions:
        if not d.fused:
            rank_zero_info(f"Optimizer step: {d.describe()}")
