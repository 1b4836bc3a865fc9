"""Callbacks the CLI tests attach with ``--trainer.callbacks+=tests.helpers.probes.<Name>``: they record, never
change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class MemoryProbe(L.Callback):
    """Writes each rank's real bytes of parameters, gradients and optimiser state after the first step."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if self.done:
            return
        self.done = True
        params = sum(_local_bytes(p) for p in pl_module.parameters())
        trainable = sum(_local_bytes(p) for p in pl_module.parameters() if p.requires_grad)
        optimizer = trainer.optimizers[0]
        states = sum(
            _local_bytes(v)
            for state in optimizer.state.values()
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and k != "step"
        )
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(
            json.dumps({"params": params, "grads": trainable, "optimizer": states})
        )


def plan_record(plan: Any) -> Any:
    """A sharding plan as JSON data (every field, dtypes as their names): equal records, equal plans."""
    import dataclasses

    return json.loads(json.dumps(dataclasses.asdict(plan), default=str))


class PlanProbe(L.Callback):
    """Writes each rank's applied sharding plan (``trainer.strategy.plan``) once the model is sharded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(plan_record(trainer.strategy.plan)))
