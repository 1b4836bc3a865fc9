"""Benchmark 1: step time of MMFSDP2Strategy vs the same plan by hand, Lightning's FSDP (FSDP1) and DDP.

    python benchmarks/step_time.py                    # both models, default sizes -> results/step_time.{json,png}
    python benchmarks/step_time.py --models lm --rounds 3 --steps 20 --warmup 5 --name step_time_dev

Both ranks run every contender in turn inside the same two processes (started once with torchrun), in rounds
whose order rotates, so that drift on a shared machine affects every contender alike. Each contender is a fresh
Trainer and LightningModule with the same seed and data. A step is the wall time between the starts of two
consecutive training batches (forward, backward, optimiser, Lightning's loop), the slower of the two ranks; the
first ``--warmup`` steps are dropped. Ratios are taken pair by pair within a round, then the median over rounds.
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
from common import StepTimer, median  # noqa: E402

PAIRS = (("mm_fsdp2", "hand_fsdp2"), ("mm_fsdp2", "fsdp1"), ("mm_fsdp2", "ddp"), ("hand_fsdp2", "fsdp1"))


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch.distributed as dist
    import variants
    from contenders import build, default_sizes, lm_fsdp2_config, seed_fsdp2_config

    common.pin_threads()
    sizes = default_sizes(args.sizes)
    contenders = args.contenders.split(",")
    total = args.warmup + args.steps + 1
    records: dict[str, list[dict[str, Any]]] = {}
    for model in args.models.split(","):
        for rnd in range(args.rounds):
            order = contenders[rnd % len(contenders) :] + contenders[: rnd % len(contenders)]
            for spec in order:
                name, variant = variants.split(spec)
                overrides = variants.config_overrides(variant)
                base = lm_fsdp2_config() if model == "lm" else seed_fsdp2_config()
                L.seed_everything(0, verbose=False)
                timer = StepTimer(common.CommCounter())
                with variants.behaviour(variant), timer.comm:
                    setup = build(
                        model,
                        name,
                        sizes,
                        total,
                        mm_config={**base, **overrides} if overrides else None,
                        mm_kwargs=variants.strategy_kwargs(variant),
                    )
                    trainer = L.Trainer(
                        strategy=setup.strategy,
                        precision=setup.precision,
                        max_steps=total,
                        callbacks=[timer],
                        **{**common.quiet_trainer_kwargs(), **setup.trainer_kwargs},
                    )
                    trainer.fit(setup.module, train_dataloaders=setup.loader)
                records.setdefault(f"{model}/{spec}", []).append(
                    {
                        "round": rnd,
                        "times": timer.step_times(args.warmup),
                        "cpu": timer.cpu_times(args.warmup),
                        "comm": timer.comm_per_step(args.warmup),
                        "losses": timer.losses,
                    }
                )
                del trainer, setup
                gc.collect()
                if dist.is_initialized():
                    dist.barrier()
    common.write_rank_json(Path(args.out), "step_time", records)


def summarize(ranks: list[dict[str, Any]], models: list[str], contenders: list[str]) -> dict[str, Any]:
    """Per model: each contender's median step per round (slower rank per step) and pairwise ratios per round."""
    out: dict[str, Any] = {}
    for model in models:
        per_round: dict[str, dict[int, float]] = {}
        cpu_round: dict[str, dict[int, float]] = {}
        losses: dict[str, list[float]] = {}
        comm: dict[str, dict[str, float]] = {}
        for name in contenders:
            runs = zip(*(r[f"{model}/{name}"] for r in ranks))
            for per_rank in runs:
                rnd = per_rank[0]["round"]
                steps = [max(ts) for ts in zip(*(p["times"] for p in per_rank))]
                per_round.setdefault(name, {})[rnd] = median(steps)
                cpu_round.setdefault(name, {})[rnd] = max(median(p["cpu"]) for p in per_rank)
                losses[name] = per_rank[0]["losses"]
                comm[name] = per_rank[0]["comm"]
        rounds = sorted(next(iter(per_round.values())))
        out[model] = {
            "median_step_ms": {n: 1e3 * median(list(v.values())) for n, v in per_round.items()},
            "per_round_ms": {n: [1e3 * v[r] for r in rounds] for n, v in per_round.items()},
            "ratios": pair_ratios(per_round, rounds),
            "median_cpu_ms": {n: 1e3 * median(list(v.values())) for n, v in cpu_round.items()},
            "per_round_cpu_ms": {n: [1e3 * v[r] for r in rounds] for n, v in cpu_round.items()},
            "cpu_ratios": pair_ratios(cpu_round, rounds),
            "final_loss": {n: v[-1] for n, v in losses.items()},
            "collectives_per_step_rank0": comm,
        }
    return out


def pair_ratios(per_round: dict[str, dict[int, float]], rounds: list[int]) -> dict[str, dict[str, Any]]:
    """For each pair, the ratio of the two contenders' medians within each round, and the median of those."""
    ratios = {}
    pairs = [*PAIRS, ("mm_fsdp2", "mm_module"), *((spec.split("@")[0], spec) for spec in per_round if "@" in spec)]
    for a, b in pairs:
        if a in per_round and b in per_round:
            each = [per_round[a][r] / per_round[b][r] for r in rounds]
            ratios[f"{a}/{b}"] = {"median": median(each), "min": min(each), "max": max(each), "per_round": each}
    return ratios


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Per model: the median step of each round (wall time, top; CPU time of the process, bottom)."""
    try:
        import matplotlib
    except ImportError:  # plotting is optional (not a test dependency); the JSON results are written already
        print(f"matplotlib is not installed: no {path.name}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(summary)
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        for row, (key, ratios, label) in enumerate(
            [("per_round_ms", "ratios", "wall"), ("per_round_cpu_ms", "cpu_ratios", "CPU")]
        ):
            ax = axes[row][col]
            data = summary[model][key]
            names = list(data)
            ax.boxplot([data[n] for n in names], tick_labels=[n.replace("@", "\n@") for n in names])
            for i, n in enumerate(names, start=1):
                ax.scatter([i] * len(data[n]), data[n], s=10, color="k", zorder=3)
            pair = next((k for k in summary[model][ratios] if k.startswith("mm_fsdp2/")), None)
            sub = f" ({pair} {summary[model][ratios][pair]['median']:.3f})" if pair else ""
            ax.set_title(f"{model}, {label}{sub}", fontsize=10)
            ax.set_ylabel(f"median {label} ms per step, per round")
            ax.tick_params(axis="x", labelsize=8)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = common.benchmark_parser(__doc__)
    parser.add_argument("--models", default="lm,vlm")
    parser.add_argument("--contenders", default="mm_fsdp2,hand_fsdp2,fsdp1,ddp")
    parser.add_argument("--sizes", default="small", help="size preset: tiny, small, medium")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--name", default="step_time", help="result file name under benchmarks/results/")
    args = common.parse_or_work(parser, worker, out="/tmp/lmm_bench/step_time")
    if args is None:
        return

    out = Path(args.out)
    machine = common.machine()
    started = time.time()
    passthrough = [
        "--models",
        args.models,
        "--contenders",
        args.contenders,
        "--rounds",
        str(args.rounds),
        "--sizes",
        args.sizes,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--out",
        str(out),
    ]
    common.launch_ranks(Path(__file__), ["--worker", *passthrough], log=out / "log.txt")
    ranks = common.read_rank_jsons(out, "step_time")
    models, contenders = args.models.split(","), args.contenders.split(",")
    summary = summarize(ranks, models, contenders)
    from contenders import VLM_NOTES, default_sizes, lm_fsdp2_config, seed_fsdp2_config

    sizes = default_sizes(args.sizes)
    result = {
        "benchmark": "step_time",
        "command": "python benchmarks/step_time.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "load_after": common.loadavg(),
        "wall_s": round(time.time() - started, 1),
        "sizes": args.sizes,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size_per_rank": sizes.batch_size,
        "lm": {"config": sizes.lm, "params": sizes.lm.num_params, "fsdp2_config": lm_fsdp2_config()},
        "vlm": {"config": sizes.vlm, "seq": sizes.vlm_seq, "fsdp2_config": seed_fsdp2_config(), "notes": VLM_NOTES},
        "summary": summary,
    }
    path = common.save_result(args.name, result)
    plot(summary, path.with_suffix(".png"), f"step time, 2 ranks (gloo), {args.rounds} rounds x {args.steps} steps")
    print(json.dumps(summary, indent=1))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
