"""AdamW's step implementations over FSDP2 (DTensor) parameters: torch's CPU default, foreach and fused.

    python benchmarks/optimizer_step.py               # -> results/optimizer_step.json

On the CPU torch steps each parameter in a Python loop; over DTensors every elementwise operation then goes
through DTensor's dispatch once per parameter. ``foreach=True`` dispatches once per group per operation;
``fused=True`` runs the whole update in one kernel call per group. One process (a 1-rank gloo group, so the
DTensors hold whole parameters: the per-rank size of a model twice as large on 2 ranks), one thread, the benchmark
LM at each size preset and a larger one (67 M parameters), median of 15 steps after 3 warm-up steps, plain tensors
for reference, and the largest difference of the updated weights from the default step's.

Evidence for the strategy's ``fused_optimizer_step=True`` default (fused is the fastest at every size); foreach
was tried first and rejected (slower than the default at the largest size).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def main() -> None:
    import torch
    import torch.distributed as dist
    from common import LMConfig
    from contenders import PRESETS, default_sizes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    common.pin_threads()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    machine = common.machine()
    rows = []
    sizes = {p: default_sizes(p).lm for p in PRESETS}
    sizes["large"] = LMConfig(vocab_size=8192, hidden_size=1024, num_layers=4, num_heads=8, seq_len=128)
    for preset, cfg in sizes.items():
        row: dict[str, object] = {"sizes": preset, "params": cfg.num_params}
        reference: list[torch.Tensor] = []
        for dtensor in (False, True):
            for impl in ("default", "foreach", "fused"):
                torch.manual_seed(0)
                model = common.DecoderLM(cfg)
                if dtensor:
                    for layer in model.layers:
                        fully_shard(layer, mesh=mesh)
                    fully_shard(model, mesh=mesh)
                kwargs = {impl: True} if impl != "default" else {}
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
                gen = torch.Generator().manual_seed(1)
                for p in model.parameters():
                    grad = torch.randn(p.shape, generator=gen)
                    p.grad = DTensor.from_local(grad, mesh, p.placements) if dtensor else grad
                times = []
                for i in range(18):
                    start = time.perf_counter()
                    optimizer.step()
                    if i >= 3:
                        times.append(time.perf_counter() - start)
                kind = "dtensor" if dtensor else "tensor"
                row[f"{kind}_{impl}_ms"] = round(1e3 * statistics.median(times), 2)
                weights = [(p.full_tensor() if dtensor else p).detach() for p in model.parameters()]
                if not reference:
                    reference = weights
                row[f"{kind}_{impl}_max_weight_diff"] = max(
                    float((a - b).abs().max()) for a, b in zip(weights, reference)
                )
        for impl in ("foreach", "fused"):
            row[f"dtensor_{impl}_over_default"] = round(row[f"dtensor_{impl}_ms"] / row["dtensor_default_ms"], 3)
        rows.append(row)
        print(row, flush=True)
    dist.destroy_process_group()
    path = common.save_result(
        "optimizer_step",
        {
            "benchmark": "optimizer_step",
            "command": "python benchmarks/optimizer_step.py",
            "machine": machine,
            "load_after": common.loadavg(),
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
