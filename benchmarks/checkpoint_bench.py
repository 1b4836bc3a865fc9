"""Checkpoint save/load: sharded DCP (``torch_dcp``) vs one consolidated ``torch.save`` on rank 0 (``torch``).

    python benchmarks/checkpoint_bench.py --devices 2 --hidden 2048 --layers 20 --dir /tmp/ckpt_bench

Trains one step of an MLP of ``layers`` Linear(hidden, hidden) blocks (20 x 2048^2 = 84M parameters, 336 MB in
fp32) with MMFSDP2Strategy on CPU, so that AdamW state exists, then saves and loads the full training state
(weights + two AdamW moments, ~1 GB) in each format ``--repeat`` times through the strategy (the code
ModelCheckpoint and ``fit(ckpt_path=...)`` run). Reported per format: wall time of save and load (the slowest rank,
best of the repeats), the peak resident-memory increase of each rank during the operation (sampled every 2 ms
from /proc, over the memory held before it), and the bytes on disk. Rank 0 prints a Markdown table and writes
``results.json`` into ``--dir``.

Two more measurements (issue #27):

* the cost of checking every byte on load: each format is loaded ``--check-repeat`` times with the content check
  and as often without it (sizes, names and safe unpickling only; the hashing switched off inside this benchmark),
  alternating, in the same run; reported: the medians (slowest rank) and their ratio;
* the time the training loop is blocked per save, ``MMFSDP2Strategy(async_save=False)`` vs ``True``: a fit of
  ``--saves`` x ``--save-every`` steps whose callback calls ``trainer.save_checkpoint`` every ``--save-every``
  steps (the call ModelCheckpoint makes) and times the call on every rank (the slowest rank per save; the median
  over the saves; a background save's wait for its predecessor counts, in the next save). The wait for the last
  background write at the end of fit is reported apart. ``--only-blocked`` measures this alone (issue #38: the
  ratio at 126 MB, ``--hidden 1024 --layers 10``, and at 961 MB, the defaults).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy, checkpoint  # noqa: E402
from lightning_mm.checkpoint import manifest, zip_manifest  # noqa: E402


class MLP(L.LightningModule):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak RSS increase over the RSS at entry, sampled in a thread."""

    def __enter__(self) -> PeakMemory:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def increase(self) -> int:
        return self.peak - self.base


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(trainer: L.Trainer, directory: Path, fmt: str, repeat: int) -> dict[str, Any]:
    strategy = trainer.strategy
    strategy.checkpoint_format = fmt
    module = trainer.lightning_module
    path = directory / f"bench-{fmt}.ckpt"
    saves, loads = [], []
    for _ in range(repeat):
        if trainer.is_global_zero and path.exists():
            checkpoint.remove(path)
        strategy.barrier()
        with PeakMemory() as mem:
            start = time.perf_counter()
            trainer.save_checkpoint(path)  # includes the barrier every rank waits on
            elapsed = time.perf_counter() - start
        saves.append((elapsed, mem.increase))
        strategy.barrier()
        with PeakMemory() as mem:
            start = time.perf_counter()
            checkpoint.load(
                path,
                module,
                strategy.optimizers,
                strict=True,
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                fitting=True,
            )
            strategy.barrier()
            elapsed = time.perf_counter() - start
        loads.append((elapsed, mem.increase))
    size = _du(path) if trainer.is_global_zero else 0
    best_save = min(saves)
    best_load = min(loads)
    return {
        "save_s": best_save[0],
        "save_peak_mb": max(m for _, m in saves) / 2**20,
        "load_s": best_load[0],
        "load_peak_mb": max(m for _, m in loads) / 2**20,
        "disk_mb": size / 2**20,
    }


@contextlib.contextmanager
def content_check(enabled: bool) -> Any:
    """The load as it is (``enabled``), or without comparing the contents of the files with their manifest."""
    if enabled:
        yield
        return
    differs, verify = manifest._differs, zip_manifest.verify
    manifest._differs = lambda *args, **kwargs: False
    zip_manifest.verify = lambda *args, **kwargs: None
    try:
        yield
    finally:
        manifest._differs, zip_manifest.verify = differs, verify


def measure_check(trainer: L.Trainer, directory: Path, fmt: str, repeat: int) -> dict[str, list[float]]:
    """Load times with and without the content check, alternating (``repeat`` each), slowest rank each time."""
    strategy = trainer.strategy
    strategy.checkpoint_format = fmt
    module = trainer.lightning_module
    path = directory / f"check-{fmt}.ckpt"
    if trainer.is_global_zero and path.exists():
        checkpoint.remove(path)
    strategy.barrier()
    trainer.save_checkpoint(path)
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    for i in range(2 * repeat):
        checked = i % 2 == 0
        strategy.barrier()
        with content_check(checked):
            start = time.perf_counter()
            checkpoint.load(
                path,
                module,
                strategy.optimizers,
                strict=True,
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                fitting=True,
            )
            strategy.barrier()
            elapsed = time.perf_counter() - start
        slowest = [None] * trainer.world_size
        dist.all_gather_object(slowest, elapsed)
        times["checked" if checked else "unchecked"].append(max(slowest))
    if trainer.is_global_zero:
        checkpoint.remove(path)
    strategy.barrier()
    return times


class TimedSaves(L.Callback):
    """``trainer.save_checkpoint`` every ``every`` steps, timed on this rank; the previous one removed."""

    def __init__(self, directory: Path, every: int) -> None:
        self.directory, self.every = directory, every
        self.blocked: list[float] = []
        self.end_wait = 0.0
        self.previous: Path | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every:
            return
        path = self.directory / f"step={trainer.global_step}.ckpt"
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        self.blocked.append(time.perf_counter() - start)
        if self.previous is not None:
            trainer.strategy.remove_checkpoint(self.previous)
        self.previous = path

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        start = time.perf_counter()
        trainer.strategy.wait_for_checkpoint()  # what the strategy's on_train_end does after the callbacks
        self.end_wait = time.perf_counter() - start


def measure_blocked(args: argparse.Namespace, directory: Path, async_save: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    module = MLP(args.hidden, args.layers)
    saves = TimedSaves(directory / f"saves-{'async' if async_save else 'sync'}", args.save_every)
    strategy = MMFSDP2Strategy(
        {"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}, empty_init=False, async_save=async_save
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.saves * args.save_every,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saves],
    )
    data = DataLoader(
        TensorDataset(torch.randn(8 * args.devices * args.saves * args.save_every, args.hidden)), batch_size=8
    )
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=data)
    fit_s = time.perf_counter() - start
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, {"blocked": saves.blocked, "end_wait": saves.end_wait, "fit_s": fit_s})
    if trainer.is_global_zero and saves.previous is not None:
        checkpoint.remove(saves.previous)
    blocked = [max(g["blocked"][i] for g in gathered) for i in range(len(saves.blocked))]
    return {
        "blocked_s": blocked,
        "median_blocked_s": statistics.median(blocked),
        "end_wait_s": max(g["end_wait"] for g in gathered),
        "fit_s": max(g["fit_s"] for g in gathered),
    }


def report_blocked(args: argparse.Namespace, directory: Path) -> None:
    blocked = {mode: measure_blocked(args, directory, mode == "async") for mode in ("sync", "async")}
    if dist.get_rank() != 0:
        return
    params = sum(p.numel() for p in MLP(args.hidden, args.layers).parameters())
    ratio = blocked["async"]["median_blocked_s"] / blocked["sync"]["median_blocked_s"]
    report = {"params": params, "state_mb": params * 12 / 1e6, "blocked_per_save": blocked, "blocked_ratio": ratio}
    (directory / "blocked.json").write_text(json.dumps(report, indent=1))
    print(f"\n{params / 1e6:.1f}M parameters, weights and AdamW state {params * 12 / 1e6:.0f} MB, {args.devices} ranks")
    print(f"Training loop blocked per save (median of {args.saves}, slowest rank), every {args.save_every} steps:")
    print("| save | blocked per save (s) | each save (s) | wait at the end of fit (s) | fit (s) |")
    print("|---|---|---|---|---|")
    for mode, b in blocked.items():
        print(
            f"| {mode} | {b['median_blocked_s']:.3f} | {[round(x, 3) for x in b['blocked_s']]} | "
            f"{b['end_wait_s']:.3f} | {b['fit_s']:.1f} |"
        )
    print(f"async / sync: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/ckpt_bench")
    parser.add_argument("--check-repeat", type=int, default=5, help="loads with and without the content check")
    parser.add_argument("--saves", type=int, default=4, help="saves timed per mode (sync, async)")
    parser.add_argument("--save-every", type=int, default=4, help="training steps between two timed saves")
    parser.add_argument("--only-blocked", action="store_true", help="measure the loop blocked per save only")
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.only_blocked:
        report_blocked(args, directory)
        return

    module = MLP(args.hidden, args.layers)
    params = sum(p.numel() for p in module.parameters())
    strategy = MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}, empty_init=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(8 * args.devices, args.hidden)), batch_size=8)
    trainer.fit(module, train_dataloaders=data)

    results = {fmt: measure(trainer, directory, fmt, args.repeat) for fmt in ("torch_dcp", "torch")}
    checks = {fmt: measure_check(trainer, directory, fmt, args.check_repeat) for fmt in ("torch_dcp", "torch")}
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, results)
    blocked = {mode: measure_blocked(args, directory, mode == "async") for mode in ("sync", "async")}
    if not trainer.is_global_zero:
        return
    rows = []
    for fmt in ("torch_dcp", "torch"):
        per_rank = [g[fmt] for g in gathered]
        rows.append(
            {
                "format": fmt,
                "save_s": max(r["save_s"] for r in per_rank),
                "load_s": max(r["load_s"] for r in per_rank),
                "save_peak_mb": [round(r["save_peak_mb"]) for r in per_rank],
                "load_peak_mb": [round(r["load_peak_mb"]) for r in per_rank],
                "disk_mb": round(per_rank[0]["disk_mb"]),
            }
        )
    check_rows = []
    for fmt, times in checks.items():
        checked, unchecked = statistics.median(times["checked"]), statistics.median(times["unchecked"])
        check_rows.append(
            {
                "format": fmt,
                "checked_s": checked,
                "unchecked_s": unchecked,
                "ratio": checked / unchecked,
                "times": times,
            }
        )
    report = {
        "params": params,
        "param_mb": params * 4 / 2**20,
        "devices": args.devices,
        "repeat": args.repeat,
        "torch": torch.__version__,
        "rows": rows,
        "load_check": check_rows,
        "blocked_per_save": blocked,
        "blocked_ratio": blocked["async"]["median_blocked_s"] / blocked["sync"]["median_blocked_s"],
    }
    (directory / "results.json").write_text(json.dumps(report, indent=1))
    print(f"\n{params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MB fp32), AdamW state, {args.devices} ranks")
    print("| format | save (s) | load (s) | save peak RSS increase per rank (MB) | load peak (MB) | on disk (MB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['format']} | {r['save_s']:.2f} | {r['load_s']:.2f} | {r['save_peak_mb']} | "
            f"{r['load_peak_mb']} | {r['disk_mb']} |"
        )
    print(f"\nLoad with / without the content check (median of {args.check_repeat}, slowest rank):")
    print("| format | load, every byte checked (s) | load, sizes only (s) | ratio |")
    print("|---|---|---|---|")
    for r in check_rows:
        print(f"| {r['format']} | {r['checked_s']:.3f} | {r['unchecked_s']:.3f} | {r['ratio']:.2f} |")
    print(f"\nTraining loop blocked per save (median of {args.saves}, slowest rank), every {args.save_every} steps:")
    print("| save | blocked per save (s) | each save (s) | wait at the end of fit (s) | fit (s) |")
    print("|---|---|---|---|---|")
    for mode, b in blocked.items():
        print(
            f"| {mode} | {b['median_blocked_s']:.3f} | {[round(x, 3) for x in b['blocked_s']]} | "
            f"{b['end_wait_s']:.3f} | {b['fit_s']:.1f} |"
        )
    print(f"async / sync: {report['blocked_ratio']:.2f}")
    for fmt in ("torch_dcp", "torch"):
        checkpoint.remove(directory / f"bench-{fmt}.ckpt")
    shutil.rmtree(directory / "checkpoints", ignore_errors=True)


if __name__ == "__main__":
    main()
