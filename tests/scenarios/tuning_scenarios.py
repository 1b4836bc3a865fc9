"""2-rank scenario for the strategy's tuned defaults: ``python tests/scenarios/tuning_scenarios.py tuning OUTDIR``.

Runs of the same model, seed and data (Lightning's launcher re-runs this script for rank 1; gloo, real
collectives): the strategy as it is, the strategy with the reshard tuning undone (every unit resharded after
forward), and the fused optimiser step against torch's own choice, across a resume and with ignored modules.
Each rank writes what it saw to ``OUTDIR/tuning.rank{R}.json``; tests/test_tuning.py asserts on it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy  # noqa: E402
from lightning_mm.core.sharded_run import ShardedRun  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario, write_result  # noqa: E402


class LM(L.LightningModule):
    """Embedding and head at the root, three blocks as units."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x = self.embed(batch[0])
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch[0].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _state(module: nn.Module) -> str:
    """SHARDED or UNSHARDED: the state of the FSDP unit that owns ``module``'s parameters."""
    group = module._get_fsdp_state()._fsdp_param_group
    return str(group.fsdp_params[0].sharded_state).split(".")[-1]


class Observe(L.Callback):
    """Between forward and backward of the third step: which units hold unsharded parameters."""

    def __init__(self) -> None:
        self.states: dict[str, str] = {}
        self.losses: list[float] = []
        self.fused: list[Any] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        if trainer.global_step == 2:
            self.states = {
                "root": _state(pl_module),
                **{f"layers.{i}": _state(m) for i, m in enumerate(pl_module.layers)},
            }

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.fused = [group.get("fused") for group in optimizer.param_groups]  # what the update reads

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def run(
    before: bool = False,
    max_steps: int = 4,
    ckpt_path: str | None = None,
    save_dir: str | None = None,
    freeze_head: bool = False,
    config: dict[str, Any] | None = None,
    **strategy_kwargs: Any,
) -> tuple[dict[str, Any], int]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 32, (32, 6), generator=torch.Generator().manual_seed(1)))
    observe = Observe()
    callbacks: list[L.Callback] = [observe]
    if save_dir is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=save_dir, every_n_train_steps=4, save_top_k=-1))
    if before:  # the strategy before the change: every unit, the root and the last one too, resharded
        ShardedRun.keep_unsharded_for_backward = False
    try:
        module = LM()
        module.head.requires_grad_(not freeze_head)
        plan = {"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"], **(config or {})}
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=save_dir is not None,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            strategy=MMFSDP2Strategy(plan, empty_init=False, **strategy_kwargs),
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    finally:
        ShardedRun.keep_unsharded_for_backward = True
    weights = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().tolist()
        for n, p in module.named_parameters()
    }
    prefetch = trainer.strategy.sharded_run.sharded.prefetch
    kept = ["<root>" if u is prefetch.root else prefetch.name(u) for u in prefetch.kept_unsharded]
    after = [group["fused"] for group in trainer.optimizers[0].param_groups]  # the user's values, given back
    return (
        {
            "states": observe.states,
            "losses": observe.losses,
            "weights": weights,
            "kept": kept,
            "fused": observe.fused,
            "fused_after": after,
        },
        trainer.global_rank,
    )


@scenario
def tuning(outdir: Path) -> None:
    """Every run above, one after the other, in one launch."""
    out = str(outdir)
    tuned, rank = run()
    results = {"tuned": tuned, "before": run(before=True)[0]}
    # The fused optimiser step: torch's choice for comparison, a checkpoint of that run resumed with the fused step,
    # and groups the fused step cannot take (a trainable ignored module) or can (a frozen one).
    results["unfused"] = run(max_steps=6, save_dir=f"{out}/ckpt", fused_optimizer_step=False)[0]
    results["resumed_fused"] = run(max_steps=6, ckpt_path=f"{out}/ckpt/epoch=0-step=4.ckpt")[0]
    results["ignored_trainable"] = run(config={"ignored_modules": ["head"]})[0]
    results["ignored_frozen"] = run(config={"ignored_modules": ["head"]}, freeze_head=True)[0]
    write_result(outdir, "tuning", results, rank)


if __name__ == "__main__":
    scenario_kit.main()
