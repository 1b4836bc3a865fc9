"""Non-finite loss / gradient scenarios on 2 CPU ranks: ``python tests/scenarios/finite_scenarios.py three_runs
WORKDIR``.

tests/test_finite.py starts the two rank processes through ``tests/helpers/scenario_kit.py::run(...,
launcher="per_rank")`` (``LOCAL_RANK`` 0 and 1, as an external launcher does), so that it sees each rank's exit status.
In one process per rank, three runs in turn:

1. ``opt_out``: ``MMFSDP2Strategy(stop_on_nonfinite=False)``, rank 1's loss NaN at step 3: trains on to the end.
2. ``inf_grad``: default; a backward hook makes rank 0's gradients infinite at step 2 (its loss stays finite).
3. ``nan_loss``: default; rank 1's loss NaN at step 3, a checkpoint after every step. The error ends the process
   (non-zero exit status on both ranks) after each rank writes what it saw.

Each run writes ``WORKDIR/<run>.rank<R>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy  # noqa: E402
from lightning_mm.core.finite import NonFiniteError  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

STEPS = 5


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


class Net(L.LightningModule):
    """Two linear layers; ``nan_at`` / ``inf_grad_at``: (step, rank) of the fault."""

    def __init__(self, nan_at: tuple[int, int] | None = None, inf_grad_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.nan_at, self.inf_grad_at = nan_at, inf_grad_at

    def configure_model(self) -> None:
        if not hasattr(self, "body"):
            torch.manual_seed(0)
            self.body = nn.Linear(6, 16)
            self.head = nn.Linear(16, 1)

    def _now(self, fault: tuple[int, int] | None) -> bool:
        return fault is not None and fault == (self.trainer.global_step, self.global_rank)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = torch.tanh(self.body(x))
        if self._now(self.inf_grad_at):
            hidden.register_hook(lambda g: torch.full_like(g, float("inf")))
        loss = nn.functional.mse_loss(self.head(hidden), y)
        if self._now(self.nan_at):
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Watch(L.Callback):
    """Per-step losses, the local shards at the start of each step, and the all-reduces between backward and the
    step's hooks (the finiteness check's: the norm with the flags folded in)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.losses: list[float] = []
        self.before: dict[str, torch.Tensor] = {}
        self.reduces: list[int] = []
        self._count: int | None = None
        self._real = dist.all_reduce

        def counting(*args: Any, **kwargs: Any) -> Any:
            if self._count is not None:
                self._count += 1
            return self._real(*args, **kwargs)

        dist.all_reduce = counting  # counts and calls the real collective

    def close(self) -> None:
        dist.all_reduce = self._real

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, idx: int) -> None:
        self.before = {n: _local(p) for n, p in module.named_parameters()}
        if trainer.global_step == 3:  # the full weights before step 3 (a collective, on every rank)
            full = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in module.named_parameters()
            }
            if trainer.global_rank == 0:
                torch.save(full, self.work / "before_step3.pt")

    def on_after_backward(self, trainer: L.Trainer, module: Any) -> None:
        self._count = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, module: Any, optimizer: Any) -> None:
        self.reduces.append(self._count or 0)
        self._count = None

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 6, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)


def _fit(work: Path, run: str, module: Net, **strategy: Any) -> dict[str, Any]:
    watch = Watch(work)
    callbacks: list[Any] = [watch]
    if run == "nan_loss":
        callbacks.append(
            ModelCheckpoint(dirpath=work / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=run == "nan_loss",
        callbacks=callbacks,
        strategy=MMFSDP2Strategy({"sharding_size": "auto"}, **strategy),
        default_root_dir=work,
    )
    result: dict[str, Any] = {"error": None}
    try:
        trainer.fit(module, train_dataloaders=_data())
    except NonFiniteError as err:
        result["error"] = str(err)
        raise
    finally:
        watch.close()
        rank = trainer.global_rank
        params = dict(module.named_parameters())
        result.update(
            losses=watch.losses,
            reduces=watch.reduces,
            global_step=trainer.global_step,
            finite_after=all(bool(torch.isfinite(_local(p)).all()) for p in params.values()),
            unchanged=all(torch.equal(_local(params[n]), v) for n, v in watch.before.items()),
        )
        (work / f"{run}.rank{rank}.json").write_text(json.dumps(result, indent=1))
    return result


@scenario(exit_cleanly=False)
def three_runs(work: Path) -> None:
    torch.set_num_threads(1)
    _fit(work, "opt_out", Net(nan_at=(3, 1)), stop_on_nonfinite=False)
    try:
        _fit(work, "inf_grad", Net(inf_grad_at=(2, 0)))
    except NonFiniteError:
        pass  # recorded; the next Trainer starts a fresh process group
    _fit(work, "nan_loss", Net(nan_at=(3, 1)))  # raises: this process ends with the error


if __name__ == "__main__":
    scenario_kit.main()
