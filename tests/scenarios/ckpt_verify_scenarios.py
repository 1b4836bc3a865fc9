"""Checks on load and background saves on 2 ranks: ``python tests/scenarios/ckpt_verify_scenarios.py SCENARIO WORKDIR``.

Real Lightning jobs on CPU (gloo, explicit CPU mesh), run through ``tests/helpers/scenario_kit.py::run``; each rank
writes ``WORKDIR/SCENARIO.rank{R}.json``; tests/test_ckpt_verify.py asserts on them and on the checkpoints left.

* ``crash`` (first): ``async_save=True``; rank 1 is killed (SIGKILL) in the middle of a background write (after
  its shard is written, before the manifest and the commit), while a ``save_top_k=1`` removal and a ``last`` link
  wait for it.
* ``main``: (0) after ``crash``: what it left, and ``ckpt_path="last"`` from each of its directories resumes.
  (1) every byte checked on load: a DCP checkpoint with 4 bytes of a weight set to 1e30 outside the
  blocks a sampled fingerprint reads, in the shard rank 1 hashes, and a ``torch`` file with one float set to NaN;
  ``fit(ckpt_path=...)`` must fail on both ranks before any step. (2) ``async_save=True`` against the same run with
  synchronous saves: same losses, same checkpoints, ``last`` and every visible checkpoint complete at every step
  while a (slowed) background write runs, and an exact resume from a checkpoint saved in the background.
* ``sigterm`` (1 rank): SIGTERM arrives while a background write is pending (with a ``save_top_k=1`` removal and
  a ``last`` link waiting for it); teardown lets the write complete and the process exits with 143.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy  # noqa: E402
from lightning_mm.checkpoint import manifest, zip_manifest  # noqa: E402
from lightning_mm.checkpoint.safe import read_dcp_metadata  # noqa: E402
from lightning_mm.datamodules.resumable import ResumableDataLoader  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

FSDP = {"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}
STEPS = 8


class Net(L.LightningModule):
    """Shards of about 800 KB per rank with AdamW state: well above the 256 KiB a sampled fingerprint reads."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(128, 512), nn.Linear(512, 128)])

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x = batch
        for layer in self.layers:
            x = torch.tanh(layer(x))
        loss = (x - batch).square().mean()
        self.log("progress", float(self.global_step), sync_dist=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Rows(Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class Recorder(L.Callback):
    """Losses; the start step; at each batch start (rank 0) whether a save was pending and whether every visible
    checkpoint of ``watch`` (links followed) is complete."""

    def __init__(self, watch: tuple[Path, ...] = ()) -> None:
        self.losses: list[float] = []
        self.start: int | None = None
        self.watch = watch
        self.pending_batches = 0
        self.incomplete: list[str] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.start = trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_rank != 0 or not self.watch:
            return
        if trainer.strategy.checkpoints.saver.pending is not None:
            self.pending_batches += 1
        for directory in self.watch:
            for entry in directory.iterdir() if directory.is_dir() else []:
                if entry.name.startswith("."):
                    continue
                if not (entry / manifest.MANIFEST_FILE).is_file():
                    self.incomplete.append(
                        f"step {trainer.global_step}: {entry.name} -> "
                        f"{os.readlink(entry) if entry.is_symlink() else entry.name}"
                    )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def fit(
    max_steps: int, ckpt_path: str | None = None, callbacks: list | None = None, devices: int = 2, **strategy: Any
) -> tuple[L.Trainer, Recorder]:
    torch.manual_seed(0)
    recorder = next((c for c in callbacks or [] if isinstance(c, Recorder)), None) or Recorder()
    callbacks = [c for c in callbacks or [] if c is not recorder] + [recorder]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=MMFSDP2Strategy(FSDP, **strategy),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=WORK,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    started = time.monotonic()
    try:
        trainer.fit(Net(), train_dataloaders=ResumableDataLoader(Rows(), batch_size=4), ckpt_path=ckpt_path)
    finally:
        print(
            f"TIMING rank {rank()} fit {max_steps} {ckpt_path} {strategy}: {time.monotonic() - started:.1f}s",
            file=sys.stderr,
        )
    return trainer, recorder


def failure(ckpt_path: Path, **strategy: Any) -> dict[str, Any]:
    """What ``fit(ckpt_path=...)`` raised on this rank, and how many steps ran."""
    recorder = Recorder()
    try:
        fit(STEPS, ckpt_path=str(ckpt_path), callbacks=[recorder], **strategy)
        return {"raised": None, "steps": len(recorder.losses)}
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error), "steps": len(recorder.losses)}


WORK = Path(".")


def use_workdir(work: Path) -> None:
    global WORK
    WORK = work


def leave_when_both_wrote(name: str) -> None:
    """Both ranks' results are written before either leaves; then no interpreter teardown (as
    tests/helpers/scenario_exit.py)."""
    for r in range(2):
        wait_for(WORK / f"{name}.rank{r}.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def dump(name: str, rank: int, data: dict[str, Any]) -> None:
    (WORK / f"{name}.rank{rank}.json").write_text(json.dumps(data, indent=1))


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ damage
def damage_dcp_weight(directory: Path) -> dict[str, Any]:
    """Set 4 bytes of the largest model weight in ``__1_0.distcp`` to 1e30, outside every sampled block."""
    shard = directory / "__1_0.distcp"
    items = [
        (info.offset, info.length, index.fqn)
        for index, info in read_dcp_metadata(directory).storage_data.items()
        if info.relative_path == shard.name and index.fqn.startswith("state_dict")
    ]
    offset, length, fqn = max(items, key=lambda item: item[1])
    size = shard.stat().st_size
    blocks = [(o, o + 64 * 1024) for o in manifest._sample_offsets(size, 4, 64 * 1024)]
    position = offset + (length // 2) // 4 * 4
    while any(start <= position < end or start <= position + 3 < end for start, end in blocks):
        position += 4
    assert position + 4 <= offset + length
    with open(shard, "r+b") as f:
        f.seek(position)
        f.write(struct.pack("<f", 1e30))
    return {"file": shard.name, "fqn": fqn, "position": position, "size": size, "blocks": blocks}


def damage_torch_float(file: Path) -> dict[str, Any]:
    """Set one float inside the largest tensor record of a ``torch`` file to NaN."""
    name, (offset, size, _) = max(zip_manifest.records(file).items(), key=lambda item: item[1][1])
    with open(file, "r+b") as f:
        f.seek(offset + size // 2 // 4 * 4)
        f.write(struct.pack("<f", float("nan")))
    return {"record": name}


# ----------------------------------------------------------------------------------------- scenarios
@scenario(exit_cleanly=False)
def main(work: Path) -> None:
    use_workdir(work)
    out: dict[str, Any] = {"after_crash": resume_after_crash()}
    # (1) Every byte checked on load.
    t, _ = fit(2)
    t.save_checkpoint(WORK / "dcp.ckpt")
    t, _ = fit(2, checkpoint_format="torch")
    t.save_checkpoint(WORK / "torch.ckpt")
    ready = WORK / "damaged.ready"
    if rank() == 0:
        shutil.copytree(WORK / "dcp.ckpt", WORK / "dcp_bad.ckpt")
        out["dcp_damage"] = damage_dcp_weight(WORK / "dcp_bad.ckpt")
        shutil.copyfile(WORK / "torch.ckpt", WORK / "torch_bad.ckpt")
        out["torch_damage"] = damage_torch_float(WORK / "torch_bad.ckpt")
        ready.touch()
    wait_for(ready)
    _, rec = fit(4, ckpt_path=str(WORK / "dcp.ckpt"))  # the undamaged one resumes
    out["dcp_resumed"] = {"start": rec.start, "steps": len(rec.losses)}
    _, rec = fit(4, ckpt_path=str(WORK / "torch.ckpt"), checkpoint_format="torch")
    out["torch_resumed"] = {"start": rec.start, "steps": len(rec.losses)}

    # (2) Background saves: the same run with synchronous and with asynchronous saves.
    runs = {}
    for mode in ("sync", "async"):
        top = ModelCheckpoint(
            dirpath=WORK / mode / "top",
            filename="{step}",
            every_n_train_steps=2,
            save_top_k=2,
            monitor="progress",
            mode="max",
            save_last="link",
        )
        every = ModelCheckpoint(
            dirpath=WORK / mode / "every", filename="{step}", every_n_train_steps=3, save_top_k=-1, save_last=True
        )
        recorder = Recorder(watch=(WORK / mode / "top", WORK / mode / "every"))
        staged: list[list[int]] = []
        if mode == "async":
            slow_background_writes(0.15)
            record_staging(staged)
        _, rec = fit(STEPS, callbacks=[top, every, recorder], async_save=mode == "async")
        runs[mode] = {
            "staged_saves": len(staged),
            "staging_buffers": len({tuple(pointers) for pointers in staged}),
            "losses": rec.losses,
            "pending_batches": rec.pending_batches,
            "incomplete": rec.incomplete,
            "top": listing(WORK / mode / "top"),
            "every": listing(WORK / mode / "every"),
            "best": sorted(Path(p).name for p in top.best_k_models),
        }
    out["runs"] = runs
    _, rec = fit(STEPS, ckpt_path=str(WORK / "async" / "every" / "step=3.ckpt"), async_save=True)
    out["async_resumed_3"] = {"start": rec.start, "losses": rec.losses}

    # (1) The damaged checkpoints, last (a failed fit destroys the process group).
    out["dcp_bad"] = failure(WORK / "dcp_bad.ckpt")
    out["torch_bad"] = failure(WORK / "torch_bad.ckpt", checkpoint_format="torch")
    dump("main", rank(), out)
    leave_when_both_wrote("main")


def record_staging(staged: list[list[int]]) -> None:
    """Note where each background save staged its tensors (the addresses of the CPU copies' storages). The staged
    tensors are kept alive, so that a save staging into new buffers cannot get the same addresses again."""
    from lightning_mm.checkpoint import writer

    original = writer.Staging.stage
    kept: list[dict[str, Any]] = []

    def stage(self: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        out = original(self, tensors)
        kept.append(out)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in out.values()]
        staged.append(sorted(t.untyped_storage().data_ptr() for t in local))
        return out

    writer.Staging.stage = stage  # type: ignore[method-assign]


def slow_background_writes(seconds: float) -> None:
    """Each background write takes ``seconds`` longer (after the shards, before the manifest): several steps."""
    original = manifest.file_entries

    def slow(paths: Any) -> Any:
        time.sleep(seconds)
        return original(paths)

    manifest.file_entries = slow


def listing(directory: Path) -> dict[str, Any]:
    return (
        {
            p.name: {
                "link": os.readlink(p) if p.is_symlink() else None,
                "complete": (p / manifest.MANIFEST_FILE).is_file(),
            }
            for p in sorted(directory.iterdir())
        }
        if directory.is_dir()
        else {}
    )


def crash_callbacks() -> list[ModelCheckpoint]:
    every = ModelCheckpoint(
        dirpath=WORK / "crash" / "every", filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    newest = ModelCheckpoint(
        dirpath=WORK / "crash" / "newest",
        filename="{step}",
        every_n_train_steps=2,
        save_top_k=1,
        monitor="progress",
        mode="max",
        save_last="link",
    )
    return [every, newest]


@scenario(exit_cleanly=False)
def crash(work: Path) -> None:
    """Saves at step 2: every/step=2, every/last, newest/step=2 (+ link); at step 4: every/step=4, every/last,
    newest/step=4, during whose background write rank 1 is killed (the removal of newest/step=2 and the `last`
    link to newest/step=4 wait for it)."""
    use_workdir(work)
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data
    count = {"n": 0}

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        future = original(self, plan, planner)
        count["n"] += 1
        if count["n"] == 6 and rank() == 1:
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_data
    fit(STEPS, callbacks=crash_callbacks(), async_save=True)


def resume_after_crash() -> dict[str, Any]:
    out: dict[str, Any] = {"entries": {name: listing(WORK / "crash" / name) for name in ("every", "newest")}}
    every, newest = crash_callbacks()
    for name, callback in (("newest", newest), ("every", every)):
        recorder = Recorder()
        try:
            fit(STEPS, ckpt_path="last", callbacks=[callback, recorder], async_save=True)
            out[name] = {"start": recorder.start, "losses": recorder.losses}
        except Exception as error:  # e.g. a `last` link to a checkpoint that was never completed
            out[name] = {"raised": f"{type(error).__name__}: {error}"}
    return out


class SigtermAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            assert trainer.strategy.checkpoints.saver.pending is not None, "the save of the step before is pending"
            (WORK / "sigterm.pending").write_text(str(trainer.strategy.checkpoints.saver.pending))
            os.kill(os.getpid(), signal.SIGTERM)


@scenario(exit_cleanly=False)
def sigterm(work: Path) -> None:
    use_workdir(work)
    slow_background_writes(1.0)
    newest = ModelCheckpoint(
        dirpath=WORK / "sigterm",
        filename="{step}",
        every_n_train_steps=2,
        save_top_k=1,
        monitor="progress",
        mode="max",
        save_last="link",
    )
    fit(STEPS, callbacks=[newest, SigtermAt(4)], devices=1, async_save=True)


if __name__ == "__main__":
    scenario_kit.main()
