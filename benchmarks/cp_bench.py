"""Context parallelism on CPU (Ulysses and KV all-gather): activation memory per rank and step time against sequence
length.

    torchrun --nproc_per_node 2 benchmarks/cp_bench.py [--lengths 2048,4096,...] [--out results/cp_bench.json]

A small Qwen3 (hidden 64, 2 layers, 2 heads of 32, 2 key/value heads, vocab 512, sdpa attention), one sequence per
rank. ``none``: each rank runs a whole sequence of its own (data parallel). ``cp2``: the two ranks form one
context-parallel group (``lightning_mm.hf.cp_attention.enable_context_parallel``) and share one sequence,
``seq / 2`` tokens each (Ulysses); ``kv2``: the same with ``context_parallel_algo`` ``kv_allgather`` (zig-zag chunks,
keys and values all-gathered). ``--modes`` picks them (default all three). Measured per rank, the larger of the
two ranks:

* activation memory: the bytes autograd keeps for backward during the forward pass (every tensor saved by an
  operation, each storage once, through ``torch.autograd.graph.saved_tensors_hooks``). This is what the decoder's
  activation memory is; it leaves out the parameters and the transient buffers of single operations;
* step time: forward + backward wall time (median of the timed repeats; one compute thread per rank).

The model is the plain Transformers one without FSDP (sharding changes parameter memory, not activations), so the
figures isolate what context parallelism changes. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def tiny_qwen3() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.Qwen3ForCausalLM(config).train()


def saved_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors the forward pass saves for backward (each storage once), and the loss."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params), loss


def measure(model: torch.nn.Module, seq: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seq + dist.get_rank())
    ids = torch.randint(10, 512, (1, seq), generator=g)
    if getattr(model, "_cp", False):  # the group shares its sequence
        dist.broadcast(ids, 0)
    batch = {"input_ids": ids, "labels": ids}
    activations, loss = saved_bytes(model, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        model(**batch).loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    result = torch.tensor([float(activations), statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return {"activation_bytes": result[0].item(), "step_s": result[1].item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cp_bench.json"))
    parser.add_argument("--modes", default="none,cp2,kv2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from lightning_mm.hf.cp_attention import enable_context_parallel

    rows = []
    for seq in [int(x) for x in args.lengths.split(",")]:
        repeats = 2 if seq <= 8192 else 1
        row: dict[str, float] = {"seq": seq}
        modes = args.modes.split(",")
        for mode in modes:
            model = tiny_qwen3()
            if mode in ("cp2", "kv2"):
                enable_context_parallel(model, dist.group.WORLD, "ulysses" if mode == "cp2" else "kv_allgather")
                model._cp = True
            figures = measure(model, seq, repeats)
            row.update({f"{mode}_{k}": v for k, v in figures.items()})
        for mode in modes[1:]:
            prefix = "" if mode == "cp2" else f"{mode}_"
            row[f"{prefix}activation_ratio"] = row[f"{mode}_activation_bytes"] / row[f"{modes[0]}_activation_bytes"]
            row[f"{prefix}step_ratio"] = row[f"{mode}_step_s"] / row[f"{modes[0]}_step_s"]
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    if dist.get_rank() == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"world_size": dist.get_world_size(), "rows": rows}, indent=1))
    # Leave without interpreter teardown: a finished gloo run can abort in it (see tests/helpers/scenario_exit.py).
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
