"""Benchmark 3: building and sharding a >= 1.5 B-parameter fp32 model, on the meta device vs eagerly on each rank.

    python benchmarks/init_bench.py                   # -> results/init.{json,png}
    python benchmarks/init_bench.py --layers 2 --hidden 256 --vocab 1024 --name init_dev   # a quick try

The decoder-only LM of ``common`` (default: hidden 2048, 28 blocks, vocab 32000: 1.54 B parameters, 6.2 GB in
fp32) is built in ``configure_model`` under MMFSDP2Strategy, every block a unit, on 2 ranks:

* ``meta`` (the default, ``empty_init=True``): parameters on the meta device, sharded, then each rank allocates
  and initialises only its shards (``reset_parameters``).
* ``eager`` (``empty_init=False``): every rank builds and initialises the whole model, which is then sharded.

Each mode runs in its own launch (a process's peak RSS cannot be reset). Each rank records its peak resident
memory (``VmHWM``) and the wall time from ``trainer.fit`` to ``on_fit_start`` (after setup: sharding,
materialisation, optimiser), and the run stops there (``max_steps=0``: no training step). Target: per-rank peak
at most about 0.6 of eager.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

MODES = ("meta", "eager")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    from contenders import LMTask, default_sizes, lm_fsdp2_config, loader_for
    from torch.distributed.tensor import DTensor

    from lightning_mm import MMFSDP2Strategy

    common.pin_threads()
    cfg = common.LMConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, seq_len=128
    )
    record: dict[str, Any] = {"mode": args.mode, "params": cfg.num_params}

    class Stop(L.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            record["setup_s"] = time.perf_counter() - started
            record["peak_rss"] = _status_kib("VmHWM") * 1024
            record["rss_after"] = _status_kib("VmRSS") * 1024
            params = list(pl_module.parameters())
            record["local_param_bytes"] = sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params
            )
            record["all_sharded"] = all(isinstance(p, DTensor) for p in params)
            record["param_count"] = sum(p.numel() for p in params)

    L.seed_everything(0, verbose=False)
    strategy = MMFSDP2Strategy(lm_fsdp2_config(), empty_init=args.mode == "meta")
    trainer = L.Trainer(strategy=strategy, max_steps=0, callbacks=[Stop()], **common.quiet_trainer_kwargs())
    loader = loader_for("lm", default_sizes("tiny"), 1)  # never iterated: max_steps=0
    record["baseline_rss"] = _status_kib("VmRSS") * 1024
    started = time.perf_counter()
    trainer.fit(LMTask(cfg), train_dataloaders=loader)
    common.write_rank_json(Path(args.out), f"init_{args.mode}", record)


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # plotting is optional (not a test dependency); the JSON results are written already
        print(f"matplotlib is not installed: no {path.name}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, mode in enumerate(MODES):
        peaks = [r["peak_rss"] / 2**30 for r in runs[mode]]
        base = [r["baseline_rss"] / 2**30 for r in runs[mode]]
        ax1.bar([i - 0.2, i + 0.2], peaks, 0.35, color=["C0", "C1"][i], label=f"{mode}: peak per rank")
        ax1.bar([i - 0.2, i + 0.2], base, 0.35, color="0.7", label="baseline (before fit)" if i == 0 else None)
        ax2.bar(i, max(r["setup_s"] for r in runs[mode]), 0.5, color=["C0", "C1"][i])
    ax1.set_xticks(range(len(MODES)), [f"{m}\n(rank 0 | rank 1)" for m in MODES])
    ax1.set_ylabel("GiB")
    ax1.set_title(f"peak RSS per rank: meta/eager = {result['peak_ratio']:.2f}")
    ax1.legend(fontsize=8)
    ax2.set_xticks(range(len(MODES)), MODES)
    ax2.set_ylabel("seconds (slower rank)")
    ax2.set_title("build + shard + init")
    fig.suptitle(f"{result['params'] / 1e9:.2f} B parameters, fp32, 2 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = common.benchmark_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--name", default="init")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = common.parse_or_work(parser, worker, out="/tmp/lmm_bench/init")
    if args is None:
        return
    out = Path(args.out)
    machine = common.machine()
    size = [
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--vocab",
        str(args.vocab),
    ]
    runs = {}
    for mode in args.modes.split(","):
        common.launch_ranks(
            Path(__file__), ["--worker", "--mode", mode, *size, "--out", str(out)], log=out / f"log_{mode}.txt"
        )
        runs[mode] = common.read_rank_jsons(out, f"init_{mode}")
    params = next(iter(runs.values()))[0]["params"]
    result: dict[str, Any] = {
        "benchmark": "init",
        "command": "python benchmarks/init_bench.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "load_after": common.loadavg(),
        "params": params,
        "fp32_bytes": params * 4,
        "config": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab},
        "runs": runs,
    }
    if set(MODES) <= set(runs):
        meta_peak = max(r["peak_rss"] for r in runs["meta"])
        eager_peak = max(r["peak_rss"] for r in runs["eager"])
        meta_inc = max(r["peak_rss"] - r["baseline_rss"] for r in runs["meta"])
        eager_inc = max(r["peak_rss"] - r["baseline_rss"] for r in runs["eager"])
        result.update(
            {
                "peak_ratio": meta_peak / eager_peak,
                "peak_increase_ratio": meta_inc / eager_inc,
                "meets_target": meta_peak / eager_peak <= 0.6,
                "setup_s": {m: max(r["setup_s"] for r in runs[m]) for m in MODES},
            }
        )
    path = common.save_result(args.name, result)
    if "peak_ratio" in result:
        plot(result, path.with_suffix(".png"))
    print(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
