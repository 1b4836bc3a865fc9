"""Compute-bound step time: MMFSDP2Strategy against the same per-rank work with no communication at all.

    python benchmarks/compute_bound.py                       # -> results/compute_bound.json
    python benchmarks/compute_bound.py --rounds 2 --steps 4  # a quicker check

Why this size: the other step-time benchmarks use models of ~1.3 M parameters, where a step is mostly Python
(hooks, Lightning's loop); they show overhead, not how close a step comes to the machine's limit. Here a GPT-style
decoder of 33.6 M parameters (hidden 512, 8 blocks, 8 heads, MLP 2048, vocabulary 8192) at sequence 256 and
2 sequences per rank makes each step ~1e11 floating-point operations per rank: with one thread per rank on this
2-core machine a step takes seconds, almost all of it in matrix products, so the ratios below measure
communication and its overlap, not Python.

Contenders, inside the same two torchrun processes, in rounds of rotating order (drift falls on all alike):

* ``no_comm``: each rank trains the same model unsharded on its own batches in a plain loop (forward, loss,
  backward, AdamW step), with no collective at all: the limit (1.0) for the same per-rank work (it steps all the
  parameters, where a sharded rank steps half).
* ``comm_only``: the collectives of an ``mm_fsdp2`` step (all-gathers and reduce-scatters at its units' sizes) with
  no compute: ``no_comm + comm_only - mm_fsdp2`` over ``comm_only`` is the share of communication hidden behind
  compute (``comm_hidden`` in the summary).
* ``mm_fsdp2``: Trainer + MMFSDP2Strategy, every block an FSDP unit, defaults (forward prefetch 0, backward 1).
* ``mm_prefetch``: the same with ``num_to_forward_prefetch: 1``, ``num_to_backward_prefetch: 2``.
* ``mm_zero2``: the same with ``reshard_after_forward: false`` (no all-gather in backward).
* ``mm_compiled``: ``mm_fsdp2`` with ``compile_modules: [model.layers.{*}]`` (inductor), compile time excluded by
  the warm-up steps.

A step is the wall time between the starts of two consecutive batches, the slower rank's; each contender's figure
per round is the median of its timed steps; ratios are taken within each round; the summary gives their medians
and [min, max] over rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

CONFIG = common.LMConfig(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, seq_len=256)
CONTENDERS = ("no_comm", "comm_only", "mm_fsdp2", "mm_prefetch", "mm_zero2", "mm_compiled")
YAML = {
    "mm_fsdp2": {},
    "mm_prefetch": {"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 2},
    "mm_zero2": {"reshard_after_forward": False},
    "mm_compiled": {"compile_modules": ["model.layers.{*}"]},
}


def _batches(args: argparse.Namespace, rank: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    n = args.warmup + args.steps
    return [torch.randint(0, CONFIG.vocab_size, (args.batch, CONFIG.seq_len + 1), generator=g) for _ in range(n)]


def run_no_comm(args: argparse.Namespace, data: list[Any]) -> list[float]:
    import torch

    torch.manual_seed(0)
    model = common.DecoderLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    starts = []
    for ids in data:
        starts.append(time.perf_counter())
        common.lm_loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    starts.append(time.perf_counter())
    return [b - a for a, b in zip(starts[args.warmup :], starts[args.warmup + 1 :])]


def run_comm_only(args: argparse.Namespace, data: list[Any]) -> list[float]:
    """The collectives of one ``mm_fsdp2`` step with no compute: per FSDP unit (the root's embedding and head, each
    block) an all-gather of its fp32 parameters in forward, again in backward for the blocks resharded after
    forward (all but the last), and a reduce-scatter of its gradients, at the units' own sizes."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    model = common.DecoderLM(CONFIG)
    blocks = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    sizes = [sum(p.numel() for p in model.parameters()) - sum(blocks), *blocks]
    buffers = [(torch.zeros(-(-n // world)), torch.zeros(-(-n // world) * world)) for n in sizes]
    starts = []
    for _ in data:
        starts.append(time.perf_counter())
        for shard, full in buffers:
            dist.all_gather_into_tensor(full, shard)
        for shard, full in reversed(buffers[1:-1]):
            dist.all_gather_into_tensor(full, shard)
        for shard, full in reversed(buffers):
            dist.reduce_scatter_tensor(shard, full)
    dist.barrier()
    starts.append(time.perf_counter())
    return [b - a for a, b in zip(starts[args.warmup :], starts[args.warmup + 1 :])]


def run_mm(args: argparse.Namespace, data: list[Any], extra: dict[str, Any]) -> list[float]:
    import lightning as L
    import torch

    from lightning_mm import MMFSDP2Strategy

    class Task(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = common.DecoderLM(CONFIG)

        def training_step(self, batch: Any, idx: int) -> Any:
            return common.lm_loss(self.model, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    starts: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            starts.append(time.perf_counter())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            starts.append(time.perf_counter())

    torch.manual_seed(0)
    config = {"sharding_size": "auto", "sub_modules_to_wrap": ["model.layers.{*}"], **extra}
    kwargs = {**common.quiet_trainer_kwargs(), "devices": 2}
    trainer = L.Trainer(
        strategy=MMFSDP2Strategy(config, empty_init=False),
        max_steps=len(data),
        use_distributed_sampler=False,
        callbacks=[Timer()],
        **kwargs,
    )  # data is already per rank
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    trainer.fit(Task(), train_dataloaders=loader)
    return [b - a for a, b in zip(starts[args.warmup :], starts[args.warmup + 1 :])]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    common.pin_threads()
    rank = common.rank()
    data = _batches(args, rank)
    names = [c for c in CONTENDERS if c in args.contenders.split(",")]
    records: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(args.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            if name == "no_comm":
                if dist.is_initialized():
                    dist.barrier()  # both ranks start together, then nothing is exchanged
                times = run_no_comm(args, data)
            elif name == "comm_only":
                times = run_comm_only(args, data)
            else:
                times = run_mm(args, data, YAML[name])
            records[name].append(common.median(times))
            gc.collect()
    common.write_rank_json(Path(args.out), "compute_bound", {"records": records, "loadavg": common.loadavg()})


def summarize(ranks: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    names = list(ranks[0]["records"])
    per_round = {n: [max(r["records"][n][i] for r in ranks) for i in range(rounds)] for n in names}
    out: dict[str, Any] = {"step_s": {n: common.median(v) for n, v in per_round.items()}, "ratios": {}}
    for name in names:
        if name != "no_comm" and "no_comm" in per_round:
            pairs = [a / b for a, b in zip(per_round[name], per_round["no_comm"])]
            out["ratios"][f"{name}/no_comm"] = {"median": common.median(pairs), "min": min(pairs), "max": max(pairs)}
    if {"no_comm", "comm_only", "mm_fsdp2"} <= set(per_round):  # the share of communication hidden behind compute
        hidden = [
            (a + c - m) / c for a, c, m in zip(per_round["no_comm"], per_round["comm_only"], per_round["mm_fsdp2"])
        ]
        out["ratios"]["comm_hidden"] = {"median": common.median(hidden), "min": min(hidden), "max": max(hidden)}
    if "mm_compiled" in per_round and "mm_fsdp2" in per_round:
        pairs = [a / b for a, b in zip(per_round["mm_fsdp2"], per_round["mm_compiled"])]
        out["ratios"]["compile_speedup"] = {"median": common.median(pairs), "min": min(pairs), "max": max(pairs)}
    return out


def main() -> None:
    parser = common.benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per contender and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--name", default="compute_bound")
    args = common.parse_or_work(parser, worker, out="/tmp/lmm_bench/compute_bound")
    if args is None:
        return
    unknown = sorted(set(args.contenders.split(",")) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"--contenders: unknown {unknown}; choose from {', '.join(CONTENDERS)}")
    out = Path(args.out)
    load_before = common.loadavg()
    passthrough = [
        f"--rounds={args.rounds}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--batch={args.batch}",
        f"--contenders={args.contenders}",
    ]
    common.launch_ranks(Path(__file__), ["--worker", *passthrough], nproc=2, log=out / "log.txt")
    ranks = common.read_rank_jsons(out, "compute_bound", 2)
    summary = summarize(ranks, args.rounds)
    result = {
        "benchmark": "compute_bound",
        "command": "python benchmarks/compute_bound.py " + " ".join(sys.argv[1:]),
        "machine": common.machine(),
        "params": CONFIG.num_params,
        "load_before": load_before,
        "load_after": ranks[0]["loadavg"],
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_per_rank": args.batch,
        "seq": CONFIG.seq_len,
        "per_rank": [r["records"] for r in ranks],
        "summary": summary,
    }
    path = common.save_result(args.name, result)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
