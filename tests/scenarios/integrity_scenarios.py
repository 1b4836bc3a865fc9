"""Checkpoint integrity on 2 ranks (``tests/helpers/scenario_kit.py``, ``launcher="torchrun"``):
``torchrun --nproc-per-node 2 tests/scenarios/integrity_scenarios.py save WORKDIR [--arg full_disk=FULL_DISK_DIR]``.

Two processes (gloo, explicit CPU mesh) shard a small model with FSDP2 and save it through
``lightning_mm.checkpoint.store.save``, each rank writing and hashing its own shard files:

* ``WORKDIR/a.ckpt`` and ``WORKDIR/b.ckpt``: two runs of the same model (different seeds), model and AdamW state;
* with ``FULL_DISK_DIR`` (a small tmpfs the caller mounted): a weights checkpoint that fits, then a training
  checkpoint that does not. Each rank records what the failed save raised in ``WORKDIR/full_disk.rank{R}.json``.

tests/test_checkpoint_integrity.py attacks copies of these checkpoints in its own process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm.checkpoint import store  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

EXTRA = {"format_version": 1, "kind": "training", "world_size": 2, "rng_point": "next_batch", "hf": []}


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with shard files above the manifest's 256 KiB sample, trained two steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 128))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 128)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def lightning_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    ckpt = {"epoch": 0, "global_step": 2, "state_dict": store.model_state(model, False)}
    if optimizer is not None:
        ckpt["optimizer_states"] = [store.optimizer_state(model, optimizer, False)]
    return ckpt


@scenario
def save(work: Path, full_disk: str | None = None) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{work / 'rendezvous'}", rank=rank, world_size=2)
    for name, seed in (("a", 1), ("b", 2)):
        model, optimizer = build(seed)
        store.save(lightning_dict(model, optimizer), work / f"{name}.ckpt", "torch_dcp", EXTRA, None)
    if full_disk:
        directory = Path(full_disk)
        store.save(lightning_dict(model, None), directory / "weights.ckpt", "torch_dcp", EXTRA, None)
        record: dict = {"raised": None}
        try:
            store.save(lightning_dict(model, optimizer), directory / "train.ckpt", "torch_dcp", EXTRA, None)
        except BaseException as error:  # what a user sees (DCP's CheckpointException is a BaseException)
            record = {
                "raised": type(error).__name__,
                "message": str(error),
                "errno": getattr(error, "errno", None),
                "mro": [c.__name__ for c in type(error).__mro__],
            }
        dist.barrier()
        record["listing"] = sorted(p.name for p in directory.iterdir())
        (work / f"full_disk.rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    scenario_kit.main()
