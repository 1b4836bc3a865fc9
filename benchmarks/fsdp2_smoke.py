"""End-to-end FSDP2 smoke test on any device: the seed's fsdp2_config.yaml on TinyVLM, then a validation pass.

    python benchmarks/fsdp2_smoke.py                          # accelerator="auto": all GPUs (Lightning's choice)
    python benchmarks/fsdp2_smoke.py --accelerator npu        # all NPUs (auto never picks them)
    python benchmarks/fsdp2_smoke.py --accelerator cuda --devices 2
    python benchmarks/fsdp2_smoke.py --accelerator cpu --devices 2 --out /tmp/smoke   # what CI runs

The same script is the CPU test in CI (tests/test_npu.py) and the check a person with GPUs or NPUs runs: the
backend follows the device (gloo, nccl, hccl). Rank 0 prints ``PASS`` or ``FAIL`` with the checks, and the exit
code is 0 only on PASS: the loss is finite and falls, the full weights are equal on every rank, sharded parameters
live on the accelerator, and validation runs on the same sharded model after training.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "custom_model"))

from train import CaptionModule, Captions  # noqa: E402

from lightning_mm import MMDataModule, MMFSDP2Strategy  # noqa: E402
from lightning_mm.accelerators import runtime  # noqa: E402

SEED_YAML = ROOT / "examples" / "custom_model" / "fsdp2_config.yaml"


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.values.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def run(args: argparse.Namespace) -> dict[str, Any]:
    L.seed_everything(0)
    losses = Losses()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=args.steps,
        strategy=MMFSDP2Strategy(fsdp2_config=str(SEED_YAML)),
        callbacks=[losses],
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = CaptionModule(lr=1e-2)
    data = MMDataModule(train_valid_test_datasets_provider=lambda: (Captions(256), Captions(32), None), batch_size=4)
    device = trainer.strategy.root_device
    runtime.reset_peak_memory_stats(device)
    trainer.fit(module, datamodule=data)
    runtime.synchronize(device)
    peak = runtime.max_memory_allocated(device)

    sharded = [p for p in module.parameters() if isinstance(p, DTensor)]
    full_sum = sum(float(p.detach().full_tensor().double().sum()) for p in sharded)  # a collective: every rank runs it
    gathered: list[float] = [0.0] * trainer.world_size
    dist.all_gather_object(gathered, full_sum)
    val = trainer.validate(module, datamodule=data, verbose=False)  # the same sharded model, same process group

    checks = {
        "loss finite": all(math.isfinite(x) for x in losses.values),
        "loss falls": len(losses.values) >= 2 and losses.values[-1] < losses.values[0],
        "weights equal on every rank": len(set(gathered)) == 1,
        f"shards on {device.type}": bool(sharded) and all(p.to_local().device.type == device.type for p in sharded),
        "validation after fit": bool(val and val[0]) and all(math.isfinite(float(v)) for v in val[0].values()),
    }
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "device": str(device),
        "backend": dist.get_backend(),
        "losses": losses.values,
        "full_weight_sum": full_sum,
        "peak_memory_bytes": peak,
        "validation": val[0] if val else None,
        "checks": checks,
        "passed": all(checks.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="auto", help="auto, cpu, cuda or npu")
    parser.add_argument("--devices", default=None, help="default: all accelerators, or 2 processes on CPU")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None, help="write each rank's result to OUT/rank{R}.json")
    args = parser.parse_args()
    if args.devices is None:
        args.devices = 2 if args.accelerator == "cpu" else "auto"
    elif args.devices.lstrip("-").isdigit():
        args.devices = int(args.devices)
    if args.accelerator == "cpu":
        torch.set_num_threads(1)

    result = run(args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1))
    if result["rank"] == 0:
        verdict = "PASS" if result["passed"] else "FAIL"
        peak = result["peak_memory_bytes"]
        memory = f"peak memory {peak / 2**20:.1f} MiB" if peak is not None else "no device memory statistics on CPU"
        print(
            f"{verdict}: FSDP2 on {result['world_size']} x {result['device'].split(':')[0]} "
            f"(backend {result['backend']}), loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}, "
            f"{memory}"
        )
        for name, ok in result["checks"].items():
            print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
