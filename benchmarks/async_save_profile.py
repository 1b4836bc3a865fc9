"""Where the training loop waits during an async save (issue #38 item 8): the blocked time of each
``trainer.save_checkpoint`` split into its parts, on every rank.

    OMP_NUM_THREADS=1 python benchmarks/async_save_profile.py --devices 2 --hidden 1024 --layers 10 --saves 8

Runs the fit of ``checkpoint_bench.py --only-blocked`` with ``async_save=True`` and times, per save, Lightning's
``dump_checkpoint`` (taking the model and optimiser state dicts: ``model_state``, ``optimizer_state``) and the
strategy's ``save_checkpoint``, and inside the writer: the gathers and barriers, the abandoned-partials scan, the
staging copy (``Staging.stage``), the meta serialised, and the submission. Rank 0 prints the median of each part
over the saves after the first (the slowest rank per save) in milliseconds.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from checkpoint_bench import MLP, TimedSaves  # noqa: E402

from lightning_mm import MMFSDP2Strategy  # noqa: E402
from lightning_mm.checkpoint import atomic, state, writer  # noqa: E402

SAVES: list[dict[str, float]] = []
_CURRENT: dict[str, float] = defaultdict(float)


def timed(owner: Any, name: str, label: str | None = None) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to the current save's ``label``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return original(*args, **kwargs)  # the background write: not the loop's time
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _CURRENT[label or name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


class ProfiledSaves(TimedSaves):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every:
            return
        _CURRENT.clear()
        super().on_train_batch_end(trainer, *args)
        SAVES.append({"total (trainer.save_checkpoint)": self.blocked[-1], **_CURRENT})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/async_save_profile")
    args = parser.parse_args()
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_mm.strategies import async_save, fsdp2
    from lightning_mm.strategies import checkpoints as strategy_checkpoints

    timed(_CheckpointConnector, "dump_checkpoint", "dump_checkpoint (Lightning's dict)")
    timed(state, "get_model_state_dict", "  model state dict")
    timed(state, "get_optimizer_state_dict", "  optimizer state dict")
    timed(fsdp2.MMFSDP2Strategy, "save_checkpoint", "strategy.save_checkpoint")
    timed(strategy_checkpoints.ckpt, "capture_rng", "  capture_rng")
    timed(strategy_checkpoints.ckpt, "collect_records", "  collect_records")
    timed(writer, "copy_loops", "  copy_loops")
    timed(writer, "gather_to_rank_zero", "  gather rng/loader to rank 0")
    timed(writer, "split_tensors", "  split_tensors")
    timed(writer, "check_weights_only", "  check_weights_only(meta)")
    timed(writer, "broadcast_from_rank_zero", "  broadcast partial path")
    timed(atomic, "abandoned_partials", "  abandoned_partials scan")
    timed(atomic, "live_writers", "  live_writers scan")
    timed(writer, "barrier", "  barrier")
    timed(writer, "save", " writer.save")
    timed(async_save.AsyncSaver, "start", " AsyncSaver.start")
    timed(writer.Staging, "stage", "  Staging.stage (copy)")
    if hasattr(writer, "raise_first_on_every_rank"):
        timed(writer, "raise_first_on_every_rank", "  refusals agreed")
    timed(writer, "raise_on_every_rank", "  refusals agreed (sync path)")
    timed(async_save.AsyncSaver, "wait", "  wait for the previous write")
    timed(fsdp2.MMFSDP2Strategy, "broadcast", "  strategy.broadcast(path)")
    timed(writer, "_serialised", "  meta serialised")

    torch.manual_seed(0)
    saves = ProfiledSaves(Path(args.dir) / "saves", args.save_every)
    strategy = MMFSDP2Strategy(
        {"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}, empty_init=False, async_save=True
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
    trainer.fit(MLP(args.hidden, args.layers), train_dataloaders=data)
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, SAVES)
    if not trainer.is_global_zero:
        return
    labels = list(dict.fromkeys(label for saves in gathered for save in saves for label in save))
    print(f"\nasync save, {args.hidden}x{args.layers}, {args.devices} ranks: median over saves 2..{args.saves} (ms)")
    print("| part (loop thread) | rank 0 | slowest rank |")
    print("|---|---|---|")
    for label in labels:
        per_rank = [[save.get(label, 0.0) for save in saves[1:]] for saves in gathered]
        slowest = [max(values) for values in zip(*per_rank)]
        print(f"| {label} | {statistics.median(per_rank[0]) * 1e3:.1f} | {statistics.median(slowest) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
