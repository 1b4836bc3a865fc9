"""2-rank fits of migrated native-route configs: ``python tests/native_scenarios.py CONFIG OUTDIR``.

``CONFIG`` is the LightningCLI config ``lightning-mm migrate`` wrote for a MindSpeed MM native-route YAML (with the
tiny stand-ins' paths); it is run as ``lightning-mm fit --config CONFIG`` does. The :class:`Recorder` callback the
config names writes, per rank, each step's loss to ``OUTDIR/native.rank{R}.json`` and the batches it trained on to
``OUTDIR/native.rank{R}.pt`` (the one-process reference in tests/test_native_route.py replays them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class Recorder(L.Callback):
    """Each training step's loss and batch, written per rank when training ends."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir
        self.losses: list[float] = []
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        self.batches.append({k: v.detach().cpu().clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank = trainer.global_rank
        strategy = trainer.strategy
        info = {
            "losses": self.losses,
            "expert_parallel_size": strategy.fsdp2_config.expert_parallel_size,
            "recompute_modules": strategy.fsdp2_config.recompute_modules,
            "units": [unit.name for unit in strategy.plan.units],
        }
        Path(self.outdir, f"native.rank{rank}.json").write_text(json.dumps(info))
        torch.save(self.batches, Path(self.outdir, f"native.rank{rank}.pt"))


if __name__ == "__main__":
    config, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    from lightning_mm.commands.train import run_lightning_cli

    run_lightning_cli(["fit", "--config", config])
    from tests.scenario_exit import exit_cleanly

    exit_cleanly()
