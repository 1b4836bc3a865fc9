"""2-rank fits fed by a MindSpeed MM data config: ``python tests/scenarios/hfdata_scenarios.py SCENARIO OUTDIR``
(scenario_kit).

``OUTDIR/data.json`` (written by the test) names a tiny Qwen2.5-VL directory and its records with absolute paths.
``Trainer(accelerator="cpu", devices=2)`` with ``MMFSDP2Strategy``; Lightning's launcher re-runs this script for
rank 1, and every rank writes what it saw to ``OUTDIR/SCENARIO.rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMDataModule, MMFSDP2Strategy  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402


class _Recorder(L.LightningModule):
    """Records the ``input_ids`` rows of every training batch; a one-weight loss keeps the optimiser busy."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        for row, mask in zip(batch["input_ids"], batch["attention_mask"]):
            self.seen.append(row[mask.bool()].tolist())
        x = batch["attention_mask"].float().mean().view(1, 1)
        return self.weight(x).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@scenario
def order(outdir: str) -> None:
    """One epoch, batch 1: each rank's sample order, its loader's sampler, and the unshuffled order expected."""
    data = MMDataModule(data_config=Path(outdir) / "data.json", batch_size=1)
    module = _Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MMFSDP2Strategy(),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    rank = trainer.global_rank
    dataset = data._splits["train"]
    expected = list(torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False))
    sampler = trainer.train_dataloader.sampler
    result: dict[str, Any] = {
        "seen": module.seen,
        "expected": [dataset[i]["input_ids"].tolist() for i in expected],
        "sampler": type(sampler).__name__,
        "shuffle": getattr(sampler, "shuffle", None),
    }
    with open(f"{outdir}/order.rank{rank}.json", "w") as handle:
        json.dump(result, handle)


@scenario
def parity(outdir: str) -> None:
    """``TransformersModel`` (the tiny VLM at ``OUTDIR/model``: Qwen2.5-VL or Qwen3-VL) under MMFSDP2Strategy,
    fp32, batch 2 per rank, fed by ``OUTDIR/data.json``: each rank's loss per step and its batches' ``input_ids``."""
    from lightning_mm import MMLightningModule
    from lightning_mm.modules import TransformersModel

    record: dict[str, Any] = {"losses": [], "rows": []}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return TransformersModel({"init_from_hf_path": str(Path(outdir) / "model")})

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            record["rows"].append(
                [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
            )
            loss = super().training_step(batch, batch_idx)
            record["losses"].append(float(loss.detach()))
            return loss

    torch.manual_seed(0)
    data = MMDataModule(data_config=Path(outdir) / "data.json", batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MMFSDP2Strategy({"sharding_size": "auto"}),
        max_steps=3,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=outdir,
    )
    trainer.fit(Module(lr=5e-3, log_grad_norm=False), datamodule=data)
    with open(f"{outdir}/parity.rank{trainer.global_rank}.json", "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    scenario_kit.main()
