"""A plain LightningModule with ``sharding_target()`` trained by MMFSDP2Strategy on 2 ranks:
``python tests/scenarios/plan_match_scenarios.py plain_target OUTDIR``.

Each rank writes the plan the strategy applied (``OUTDIR/plain_target.rank{R}.json``);
tests/test_plan_matches_strategy.py compares it with the plan ``MMFSDP2Strategy.plan_for`` (what
``lightning-mm plan`` prints) builds for the same module on the meta device, without processes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.probes import plan_record  # noqa: E402
from tests.helpers.scenario_kit import scenario, write_result  # noqa: E402

# Paths relative to the sharding target (the backbone), not to the LightningModule.
CONFIG = {
    "sharding_size": "auto",
    "sub_modules_to_wrap": ["blocks.{*}"],
    "ignored_modules": ["embed"],
    "recompute_modules": ["blocks.1"],
    "num_to_backward_prefetch": 2,
}
PRECISION = "bf16-mixed"


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)  # ignored: fp32, outside FSDP
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:  # FSDP units: their inputs are cast to bf16
            x = torch.tanh(block(x))
        return x


class PlainWithTarget(L.LightningModule):
    """Not an MMLightningModule: the config's paths are relative to what ``sharding_target()`` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Linear(8, 1)

    def sharding_target(self) -> nn.Module:
        return self.backbone

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 1))
        return torch.utils.data.DataLoader(data, batch_size=2)


@scenario
def plain_target(out: Path) -> None:
    """Fit one step; each rank writes the plan its strategy applied."""

    class Record(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            write_result(out, "plain_target", plan_record(trainer.strategy.plan), rank=trainer.global_rank)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MMFSDP2Strategy(fsdp2_config=CONFIG),
        precision=PRECISION,
        max_steps=1,
        callbacks=[Record()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(PlainWithTarget())


if __name__ == "__main__":
    scenario_kit.main()
