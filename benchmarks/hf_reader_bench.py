"""Reading a safetensors checkpoint into FSDP2 shards: lightning-mm's reader against torch DCP's
``HuggingFaceStorageReader``, on 2 CPU ranks (gloo), in peak memory and time.

    OMP_NUM_THREADS=1 python benchmarks/hf_reader_bench.py --dir /tmp/hf_reader_bench [--hidden 2048 --layers 12]

A stack of ``--layers`` ``Linear(hidden, hidden)`` layers is written once, with random weights, as
``--dir/model.safetensors`` (keys as the model names them). Each round starts fresh 2-rank processes per reader,
alternating the order (``ours``, ``dcp``, then ``dcp``, ``ours``, ...). Each rank builds the model on the meta
device, shards every layer and the root with ``fully_shard`` over a CPU mesh, allocates its shards
(``to_empty``), then loads with

* ``ours``: ``build_load_plan`` + ``load_local_shards`` (``lightning_mm/hf/loading.py``): plain reads of
  each rank's rows into the shard's memory;
* ``dcp``: ``torch.distributed.checkpoint.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(dir))``.

Per rank: the wall time of the load (modules imported before; the slower rank) and the peak resident memory over
the resident memory before the load (sampled every 2 ms). Both readers must give the same bytes: each rank's checksum
of its shards is compared. Prints a Markdown table of medians and the per-round ratio dcp / ours; the numbers go to
``--dir/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pretrained_load_bench import PeakSampler  # noqa: E402

MB = 1e6


def _model(hidden: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers)))


def write_checkpoint(directory: Path, hidden: int, layers: int) -> Path:
    from safetensors.torch import save_file

    path = directory / "model.safetensors"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        save_file({k: v.contiguous() for k, v in _model(hidden, layers).state_dict().items()}, str(path))
    return path


def rank_main(reader: str, directory: str, hidden: int, layers: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_mm.hf.loading import load_local_shards
    from lightning_mm.hf.pretrained_index import SafetensorsIndex, build_load_plan  # imported before timing

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = _model(hidden, layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    dist.barrier()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    if reader == "ours":
        load_local_shards(model, build_load_plan(model, SafetensorsIndex.from_directory(directory)))
    else:
        dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(directory))
    seconds = time.perf_counter() - start
    sampler.stop()
    peak = sampler.peak - sampler.base
    dist.barrier()
    checksum = sum(
        float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum()) for p in model.parameters()
    )
    Path(out, f"{reader}.rank{rank}.json").write_text(
        json.dumps({"seconds": seconds, "peak_increase": peak, "checksum": checksum})
    )
    dist.destroy_process_group()


def run_once(reader: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank-main",
                    reader,
                    "--dir",
                    str(args.dir),
                    "--hidden",
                    str(args.hidden),
                    "--layers",
                    str(args.layers),
                    "--out",
                    str(out),
                ],
                env=env,
            )
        )
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise SystemExit(f"{reader}: a rank failed")
    return [json.loads((out / f"{reader}.rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hf_reader_bench"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank-main", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.rank_main, str(args.dir), args.hidden, args.layers, args.out)
        return
    path = write_checkpoint(args.dir, args.hidden, args.layers)
    out = args.dir / "ranks"
    out.mkdir(exist_ok=True)
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    for i in range(args.rounds):
        order = ("ours", "dcp") if i % 2 == 0 else ("dcp", "ours")
        rounds.append({reader: run_once(reader, args, out) for reader in order})
        for rank in range(2):
            a, b = rounds[-1]["ours"][rank]["checksum"], rounds[-1]["dcp"][rank]["checksum"]
            if a != b:
                raise SystemExit(f"round {i}, rank {rank}: the readers loaded different values ({a} vs {b})")
    table = {}
    for reader in ("ours", "dcp"):
        table[reader] = {
            "seconds": statistics.median(max(r["seconds"] for r in rd[reader]) for rd in rounds),
            "peak_increase_mb": [
                statistics.median(rd[reader][k]["peak_increase"] for rd in rounds) / MB for k in (0, 1)
            ],
        }
    ratios = [max(r["seconds"] for r in rd["dcp"]) / max(r["seconds"] for r in rd["ours"]) for rd in rounds]
    size = path.stat().st_size / MB
    print(
        f"checkpoint {size:.0f} MB ({args.layers} x Linear({args.hidden}, {args.hidden}), fp32), {args.rounds} "
        f"rounds, load average before: {os.getloadavg()[0]:.2f}"
    )
    print("| reader | load s (median, slower rank) | peak RSS increase per rank, MB (median) |")
    print("|---|---:|---|")
    for reader, row in table.items():
        print(f"| {reader} | {row['seconds']:.3f} | {[round(x) for x in row['peak_increase_mb']]} |")
    print(f"time dcp / ours per round: {[round(r, 2) for r in ratios]} (median {statistics.median(ratios):.2f})")
    (args.dir / "results.json").write_text(
        json.dumps({"table": table, "ratios": ratios, "rounds": rounds, "checkpoint_mb": size}, indent=1)
    )


if __name__ == "__main__":
    main()
