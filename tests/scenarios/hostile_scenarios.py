"""2-rank fits on hostile data, and with a rank that hangs: ``python tests/scenarios/hostile_scenarios.py SCENARIO
OUTDIR``.

Like ``tests/scenarios/dist_scenarios.py``: ``Trainer(accelerator="cpu", devices=2)``, Lightning's launcher re-runs this
script for rank 1, and every rank writes what it saw to ``OUTDIR/SCENARIO.rank{R}.json``. The ``hang_*`` scenarios
never end on their own: one rank blocks for good (the test then signals a rank; each rank writes
``OUTDIR/pid.rank{R}``, and the blocking one ``OUTDIR/hung.rank{R}`` just before it blocks).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.captioning.module import CaptioningModule  # noqa: E402
from lightning_mm import MMDataModule, MMFSDP2Strategy  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402


@scenario
def corrupt_image(outdir: str) -> None:
    """``OUTDIR/data/data.yaml`` (written by the test: 8 records, one corrupt), 2 ranks, batch 2, 2 epochs."""
    data = MMDataModule.from_config(Path(outdir) / "data" / "data.yaml")
    module = CaptioningModule(vocab_size=12, hidden_size=16, num_layers=1)
    strategy = MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["text_decoder.decoder.layers.{*}"]})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    report = data.reports["train"]
    result: dict[str, Any] = {"steps": trainer.global_step, "skipped": report.skipped, "problems": report.problems}
    with open(f"{outdir}/corrupt_image.rank{trainer.global_rank}.json", "w") as handle:
        json.dump(result, handle)


STOP_TIMEOUT = 3.0  # MMFSDP2Strategy(stop_timeout=...) of the hang_* scenarios (tests/test_hostile_fit.py)


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _block_forever(how: str) -> None:
    """Never return, without coming back to the interpreter (so no Python signal handler can run here)."""
    if how == "collective":
        dist.recv(torch.zeros(1), src=0)  # rank 0 never sends: a gloo wait, as with a peer that hangs
    else:
        torch.futures.Future().wait()  # never completed: a C++ wait, the GIL released


class _Hang(L.Callback):
    """Rank ``rank`` blocks for good ``where``: in ``setup`` (a long setup) or at the third training batch."""

    def __init__(self, outdir: str, rank: int, where: str, how: str) -> None:
        self.outdir, self.rank, self.where, self.how = outdir, rank, where, how

    def _hang(self, trainer: L.Trainer) -> None:
        if trainer.global_rank == self.rank:
            Path(self.outdir, f"hung.rank{trainer.global_rank}").write_text(str(os.getpid()))
            _block_forever(self.how)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        Path(self.outdir, f"pid.rank{trainer.global_rank}").write_text(str(os.getpid()))
        if self.where == "setup":
            self._hang(trainer)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.where == "step" and batch_idx == 2:
            self._hang(trainer)


def _fit_hanging(outdir: str, rank: int, where: str, how: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MMFSDP2Strategy(stop_timeout=STOP_TIMEOUT),
        max_steps=100_000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Hang(outdir, rank, where, how)],
    )
    trainer.fit(_Net(), train_dataloaders=torch.utils.data.DataLoader(torch.randn(4096, 8), batch_size=2))


@scenario
def hang_collective(outdir: str) -> None:
    """Rank 1 waits at its third batch in a collective rank 0 never joins; rank 0 blocks in its next one."""
    _fit_hanging(outdir, rank=1, where="step", how="collective")


@scenario
def hang_c_call(outdir: str) -> None:
    """Rank 1 blocks at its third batch in a C++ wait that never ends; rank 0 blocks in its next collective."""
    _fit_hanging(outdir, rank=1, where="step", how="c_call")


@scenario
def hang_setup(outdir: str) -> None:
    """Rank 0 blocks in a C++ wait during setup (``Callback.setup``, after the process group started)."""
    _fit_hanging(outdir, rank=0, where="setup", how="c_call")


if __name__ == "__main__":
    scenario_kit.main()
