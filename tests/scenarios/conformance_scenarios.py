"""Lightning-conformance scenarios: ``python tests/scenarios/conformance_scenarios.py SCENARIO OUTDIR`` (scenario_kit).

Real 2-rank Lightning jobs on CPU (gloo, explicit CPU mesh); Lightning's launcher re-runs this script for rank 1.
Each rank writes what it saw to ``OUTDIR/SCENARIO.rank{R}.json``; tests/test_conformance.py asserts on it.

* ``callbacks``: ``StochasticWeightAveraging`` is refused before any batch; ``Trainer(sync_batchnorm=True)``
  converts BatchNorm layers (and warns that on CPU a training forward through them fails, which it then does);
  without it they stay per-rank; during a run the rendezvous store listens on the loopback interface only.
* ``sigterm``: trains slowly until the test sends SIGTERM to one rank; every rank writes its pid when training
  starts, a SIGTERM handler installed before the run records that it was called, and rank 0 records how its
  launched rank process ended.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

FSDP = {"sharding_size": "auto"}


class BNNet(L.LightningModule):
    def __init__(self, pause: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.pause = pause

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        if self.pause:
            time.sleep(self.pause)
        return self.layers(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Seen(L.Callback):
    """What the run did: the BatchNorm classes at fit start and the training batches started."""

    def __init__(self) -> None:
        self.batches = 0
        self.norms: list[str] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        norms = (nn.BatchNorm1d, nn.SyncBatchNorm)
        self.norms = [type(m).__name__ for m in pl_module.modules() if isinstance(m, norms)]

    def on_train_batch_start(self, *args: Any) -> None:
        self.batches += 1


def data(n: int = 64) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.randn(n, 8, generator=torch.Generator().manual_seed(0)), batch_size=4)


def trainer(max_steps: int = 4, **kwargs: Any) -> L.Trainer:
    kwargs.setdefault("strategy", MMFSDP2Strategy(FSDP))
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def dump(name: str, outdir: str, rank: int, out: dict[str, Any]) -> None:
    Path(outdir, f"{name}.rank{rank}.json").write_text(json.dumps(out, indent=1))


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


class StoreSockets(L.Callback):
    def on_train_batch_start(self, *args: Any) -> None:
        if not hasattr(self, "addresses"):
            self.addresses = _listening(int(os.environ["MASTER_PORT"]))


@scenario(exit_cleanly=False)
def callbacks(outdir: str) -> None:
    out: dict[str, Any] = {}
    # 1. StochasticWeightAveraging: refused at setup, before any batch.
    seen = Seen()
    t = trainer(max_epochs=3, callbacks=[StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1), seen])
    try:
        t.fit(BNNet(), train_dataloaders=data())
        out["swa"] = "trained"
    except Exception as err:  # noqa: BLE001 - recorded and asserted on
        out["swa"] = f"{type(err).__name__}: {err}"
    out["swa_batches"] = seen.batches

    # 2. Without sync_batchnorm: per-rank BatchNorm, training works; the rendezvous store listens on loopback only.
    seen, sockets = Seen(), StoreSockets()
    t = trainer(callbacks=[seen, sockets])
    t.fit(BNNet(), train_dataloaders=data())
    out["plain_norms"] = seen.norms
    out["plain_batches"] = seen.batches
    out["store_listens_on"] = getattr(sockets, "addresses", None)
    # 3. sync_batchnorm=True: converted before sharding; a training forward on CPU then fails as torch says
    # (last, since the failed run destroys the process group).
    seen = Seen()
    t = trainer(sync_batchnorm=True, callbacks=[seen])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t.fit(BNNet(), train_dataloaders=data())
            out["sync_fit"] = "trained"
        except Exception as err:  # noqa: BLE001
            out["sync_fit"] = f"{type(err).__name__}: {err}"
    out["sync_norms"] = seen.norms
    out["sync_warnings"] = [str(w.message) for w in caught if "sync_batchnorm" in str(w.message)]
    out["layer_sync"] = type(t.strategy._layer_sync).__name__

    dump("callbacks", outdir, t.global_rank, out)


class Pids(L.Callback):
    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        Path(self.outdir, f"pid.rank{trainer.global_rank}").write_text(str(os.getpid()))


@scenario(exit_cleanly=False)
def sigterm(outdir: str) -> None:
    rank = os.environ.get("LOCAL_RANK", "0")  # set by Lightning's launcher for the rank it starts
    # A SIGTERM handler of the user's own, installed before the run: it must still be called.
    signal.signal(signal.SIGTERM, lambda *_: Path(outdir, f"user_handler.rank{rank}").write_text("called"))
    t = trainer(max_steps=100_000, strategy=MMFSDP2Strategy(FSDP, stop_timeout=5), callbacks=[Pids(outdir)])
    try:
        t.fit(BNNet(pause=0.05), train_dataloaders=data(10_000))
    finally:
        launcher = t.strategy.launcher
        for proc in getattr(launcher, "procs", []):  # rank 0: how did the rank it launched end?
            try:
                code = proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                code = "running"
            Path(outdir, "child_status").write_text(str(code))


if __name__ == "__main__":
    scenario_kit.main()
