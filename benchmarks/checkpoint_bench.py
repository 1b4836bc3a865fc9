"""Checkpoint save/load: sharded DCP (``torch_dcp``) vs one consolidated ``torch.save`` on rank 0 (``torch``).

    python benchmarks/checkpoint_bench.py --devices 2 --hidden 2048 --layers 20 --dir /tmp/ckpt_bench

Trains one step of an MLP of ``layers`` Linear(hidden, hidden) blocks (20 x 2048^2 = 84M parameters, 336 MB in
fp32) with MMFSDP2Strategy on CPU, so that AdamW state exists, then saves and loads the full training state
(weights + two AdamW moments, ~1 GB) in each format ``--repeat`` times through the strategy (the code
ModelCheckpoint and ``fit(ckpt_path=...)`` run). Reported per format: wall time of save and load (the slowest rank,
best of the repeats), the peak resident-memory increase of each rank during the operation (sampled every 2 ms
from /proc, over the memory held before it), and the bytes on disk. Rank 0 prints a Markdown table and writes
``results.json`` into ``--dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
            checkpoint.load(path, module, strategy.optimizers, strict=True, rank=trainer.global_rank,
                            world_size=trainer.world_size, fitting=True)
            strategy.barrier()
            elapsed = time.perf_counter() - start
        loads.append((elapsed, mem.increase))
    size = _du(path) if trainer.is_global_zero else 0
    best_save = min(saves)
    best_load = min(loads)
    return {"save_s": best_save[0], "save_peak_mb": max(m for _, m in saves) / 2**20,
            "load_s": best_load[0], "load_peak_mb": max(m for _, m in loads) / 2**20, "disk_mb": size / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/ckpt_bench")
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    module = MLP(args.hidden, args.layers)
    params = sum(p.numel() for p in module.parameters())
    strategy = MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}, empty_init=False)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(8 * args.devices, args.hidden)), batch_size=8)
    trainer.fit(module, train_dataloaders=data)

    results = {fmt: measure(trainer, directory, fmt, args.repeat) for fmt in ("torch_dcp", "torch")}
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, results)
    if not trainer.is_global_zero:
        return
    rows = []
    for fmt in ("torch_dcp", "torch"):
        per_rank = [g[fmt] for g in gathered]
        rows.append({
            "format": fmt,
            "save_s": max(r["save_s"] for r in per_rank),
            "load_s": max(r["load_s"] for r in per_rank),
            "save_peak_mb": [round(r["save_peak_mb"]) for r in per_rank],
            "load_peak_mb": [round(r["load_peak_mb"]) for r in per_rank],
            "disk_mb": round(per_rank[0]["disk_mb"]),
        })
    report = {"params": params, "param_mb": params * 4 / 2**20, "devices": args.devices, "repeat": args.repeat,
              "torch": torch.__version__, "rows": rows}
    (directory / "results.json").write_text(json.dumps(report, indent=1))
    print(f"\n{params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MB fp32), AdamW state, {args.devices} ranks")
    print("| format | save (s) | load (s) | save peak RSS increase per rank (MB) | load peak (MB) | on disk (MB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['save_s']:.2f} | {r['load_s']:.2f} | {r['save_peak_mb']} | "
              f"{r['load_peak_mb']} | {r['disk_mb']} |")
    for fmt in ("torch_dcp", "torch"):
        checkpoint.remove(directory / f"bench-{fmt}.ckpt")
    shutil.rmtree(directory / "checkpoints", ignore_errors=True)


if __name__ == "__main__":
    main()
