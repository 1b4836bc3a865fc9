"""A rejected tuning, kept as evidence: AdamW's foreach step vs torch's CPU default over FSDP2 (DTensor) parameters.

    python benchmarks/optimizer_step.py               # -> results/optimizer_step.json

On the CPU torch steps each parameter in a Python loop; over DTensors every elementwise operation then goes
through DTensor's dispatch once per parameter. ``foreach=True`` dispatches once per group. One process (a 1-rank
gloo group, so the DTensors hold whole parameters: the per-rank size of a model twice as large on 2 ranks), one
thread, the benchmark LM at each size preset and a larger one (67 M parameters), median of 15 steps after 3
warm-up steps, plain tensors for reference. The strategy does not switch to foreach: what it saves is a roughly
fixed cost per parameter, its share shrinks as parameters grow, and at the largest size it was slower.
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
        for dtensor in (False, True):
            for foreach in (None, True):
                torch.manual_seed(0)
                model = common.DecoderLM(cfg)
                if dtensor:
                    for layer in model.layers:
                        fully_shard(layer, mesh=mesh)
                    fully_shard(model, mesh=mesh)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                times = []
                for i in range(18):
                    start = time.perf_counter()
                    optimizer.step()
                    if i >= 3:
                        times.append(time.perf_counter() - start)
                key = f"{'dtensor' if dtensor else 'tensor'}_{'foreach' if foreach else 'default'}_ms"
                row[key] = round(1e3 * statistics.median(times), 2)
        row["dtensor_foreach_over_default"] = round(row["dtensor_foreach_ms"] / row["dtensor_default_ms"], 3)
        rows.append(row)
        print(row, flush=True)
    dist.destroy_process_group()
    path = common.save_result("optimizer_step", {
        "benchmark": "optimizer_step", "command": "python benchmarks/optimizer_step.py", "machine": machine,
        "load_after": common.loadavg(), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
