"""2-rank fits of migrated native-route configs (tests/helpers/scenario_kit.py):
``python tests/scenarios/native_scenarios.py fit_config OUTDIR --arg config=CONFIG``.

``CONFIG`` is the LightningCLI config ``lightning-mm migrate`` wrote for a MindSpeed MM native-route YAML (with the
tiny stand-ins' paths); it is run as ``lightning-mm fit --config CONFIG`` does. The :class:`Recorder` callback the
config names writes, per rank, each step's loss to ``OUTDIR/native.rank{R}.json`` and the batches it trained on to
``OUTDIR/native.rank{R}.pt`` (the one-process reference in tests/test_native_route.py replays them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402


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


class JobShape(L.Callback):
    """What the job ran as, per rank: world size, nodes, accumulation and optimizer steps (``OUTDIR/job.rank{R}``)."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir
        self.batches = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batches += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import os

        info = {
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "node_rank": int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "-1"))),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "global_step": trainer.global_step,
            "micro_batches": self.batches,
            "batch_size": trainer.datamodule.batch_size,
        }
        Path(self.outdir, f"job.rank{trainer.global_rank}.json").write_text(json.dumps(info))


@scenario
def fit_config(outdir: Path, config: str) -> None:
    """``lightning-mm fit --config CONFIG`` (the config's :class:`Recorder` writes where it names); several configs
    joined by ``os.pathsep`` are fitted one after the other in the same processes."""
    import os

    from lightning_mm.commands.train import run_lightning_cli

    for path in config.split(os.pathsep):
        run_lightning_cli(["fit", "--config", path])


if __name__ == "__main__":
    scenario_kit.main()
