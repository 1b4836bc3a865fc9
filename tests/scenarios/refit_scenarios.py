"""Several ``trainer.fit`` calls in one 2-rank launch (tests/helpers/scenario_kit.py): fits that fail after the process
group exists, then fits that succeed, in the same processes (``tests/test_refit.py``).

A failed run destroys the process group (``lightning_mm.strategies.process_group``) and the next ``fit`` creates a
new one on the same rendezvous port and store. A run that fails on one rank leaves the other rank in a collective,
which fails only once the failed rank's group is freed.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mm import MMFSDP2Strategy
from tests.helpers import scenario_kit
from tests.helpers.scenario_kit import scenario, write_result

# How a fit fails: in ``configure_optimizers`` (setup, after sharding) on both ranks, or in the first training step
# on both ranks or on one rank only (the other one is then failed by the first collective it shares with it).
FAILURES = ("setup", "step", "step_rank0", "step_rank1")


class Failure(RuntimeError):
    """The error a failing fit raises on purpose."""


class Net(L.LightningModule):
    def __init__(self, fail: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 1)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)

    def _fails_here(self, where: str) -> bool:
        return self.fail == where or self.fail == f"{where}_rank{self.global_rank}"

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        if self._fails_here("step"):
            raise Failure(f"step on rank {self.global_rank}")
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self._fails_here("setup"):
            raise Failure(f"setup on rank {self.global_rank}")
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer() -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}, stop_timeout=60),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _outcome(model: Net) -> dict[str, Any]:
    """Fit ``model`` with a new Trainer: the steps done or the error raised, and the warnings about a failed run's
    group still held (``lightning_mm.strategies.process_group``)."""
    trainer = _trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model)
            outcome: dict[str, Any] = {"fail": model.fail, "error": None, "steps": trainer.global_step}
        except Failure as err:
            outcome = {"fail": model.fail, "error": f"Failure: {err}"}
        except Exception as err:  # the peer's failure, seen in a collective
            outcome = {"fail": model.fail, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    outcome["held"] = [str(w.message) for w in caught if "earlier failed run" in str(w.message)]
    # progress on stderr: the test's report of a hang shows how far each rank got
    print(f"refit_scenarios: rank {trainer.global_rank}: {outcome}", file=sys.stderr, flush=True)
    return outcome


@scenario
def fail_then_fit(workdir: Any, rounds: str = "2") -> None:
    """``rounds`` times: one failing fit of each kind in :data:`FAILURES` (its model and Trainer dropped after it),
    then a successful fit. Last, a failing fit whose model is kept, then a successful fit (its warning). Every rank
    records each fit's outcome, in order."""
    record: list[dict[str, Any]] = []
    start = time.monotonic()
    for fail in [*FAILURES, None] * int(rounds):
        record.append(_outcome(Net(fail)))
    kept = Net("setup")
    record.append(_outcome(kept))
    record.append(_outcome(Net()))
    write_result(workdir, "fail_then_fit", {"fits": record, "seconds": time.monotonic() - start}, kept.global_rank)


if __name__ == "__main__":
    scenario_kit.main()
