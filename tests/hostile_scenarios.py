"""2-rank fits on hostile data: ``python tests/hostile_scenarios.py SCENARIO OUTDIR``.

Like ``tests/dist_scenarios.py``: ``Trainer(accelerator="cpu", devices=2)``, Lightning's launcher re-runs this
script for rank 1, and every rank writes what it saw to ``OUTDIR/SCENARIO.rank{R}.json``.
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
sys.path.insert(0, str(ROOT))

from examples.captioning.module import CaptioningModule  # noqa: E402
from lightning_mm import MMDataModule, MMFSDP2Strategy  # noqa: E402


def scenario_corrupt_image(outdir: str) -> None:
    """``OUTDIR/data/data.yaml`` (written by the test: 8 records, one corrupt), 2 ranks, batch 2, 2 epochs."""
    data = MMDataModule.from_config(Path(outdir) / "data" / "data.yaml")
    module = CaptioningModule(vocab_size=12, hidden_size=16, num_layers=1)
    strategy = MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["text_decoder.decoder.layers.{*}"]})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    report = data.reports["train"]
    result: dict[str, Any] = {"steps": trainer.global_step, "skipped": report.skipped, "problems": report.problems}
    with open(f"{outdir}/corrupt_image.rank{trainer.global_rank}.json", "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    name, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    globals()[f"scenario_{name}"](out)
    from tests.scenario_exit import exit_cleanly

    exit_cleanly()
