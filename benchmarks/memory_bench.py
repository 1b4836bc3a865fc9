"""Benchmark 2: memory per rank. Exact bytes of parameters, gradients and optimiser state, and tracked peaks.

    python benchmarks/memory_bench.py                 # -> results/memory.{json,png}

Part 1 (exact bytes): ``lightning_mm.core.memory.per_rank_memory`` computes, from the meta model and the
plan alone, what the most loaded rank holds under MMFSDP2Strategy and under DDP; the same quantities are then
measured on 2 real ranks after two training steps (local shards of parameters, gradients and AdamW's
``exp_avg``/``exp_avg_sq``; AdamW's scalar ``step`` counters are listed separately). Target: at most 1/N of DDP
plus 1%.

Part 2 (tracked peak): torch's ``FSDPMemTracker`` (``torch.distributed._tools``; it follows every tensor FSDP2,
autograd and the optimiser allocate, by category) records the peak of training steps 2 and 3 (one tracker each,
the larger kept) on each rank for several YAML settings of the same model: ``reshard_after_forward`` true/false,
with and without recomputation, with CPU offload, and the strategy before its root/last-unit tuning. DDP is
tracked with torch's ``MemTracker`` for comparison. Byte counts do not depend on the machine's load.
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

# name -> (contender spec, FSDP2 config overrides); the base config is contenders.lm_fsdp2_config().
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "zero3": ("mm_fsdp2", {}),
    "zero3_before_keep": ("mm_fsdp2@before_keep", {}),
    "zero3_fwd_prefetch1": ("mm_fsdp2", {"num_to_forward_prefetch": 1}),
    "zero2": ("mm_fsdp2", {"reshard_after_forward": False}),
    "zero3_recompute": ("mm_fsdp2", {"recompute_modules": ["model.layers.{*}"]}),
    "zero2_recompute": ("mm_fsdp2", {"reshard_after_forward": False, "recompute_modules": ["model.layers.{*}"]}),
    "zero3_offload": ("mm_fsdp2", {"offload_to_cpu": True}),
    "ddp": ("ddp", {}),
}
TRACKED_STEPS = (1, 2)  # 0-based batch indices: after the first step has created the optimiser state


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class Measure:
    """A callback measuring actual bytes held (step 1) and the tracked peak of ``TRACKED_STEPS``."""

    def __init__(self, fsdp: bool) -> None:
        import lightning as L

        outer = self

        class _CB(L.Callback):
            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                if trainer.global_step == 1:
                    outer.bytes["params"] = sum(_local_bytes(p) for p in pl_module.parameters())
                    outer.bytes["grads"] = sum(
                        _local_bytes(p.grad) for p in pl_module.parameters() if p.grad is not None
                    )

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
                if idx in TRACKED_STEPS:
                    outer.start_tracking(pl_module, trainer.optimizers[0], batch)

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                if idx == 1:
                    states = [s for s in trainer.optimizers[0].state.values()]
                    outer.bytes["optimizer"] = sum(_local_bytes(v) for s in states for k, v in s.items() if k != "step")
                    outer.bytes["optimizer_step_counters"] = sum(_local_bytes(s["step"]) for s in states if "step" in s)
                if idx in TRACKED_STEPS:
                    outer.stop_tracking()

        self.callback = _CB()
        self.fsdp = fsdp
        self.bytes: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._tracker: Any = None

    def start_tracking(self, module: Any, optimizer: Any, batch: Any) -> None:
        if self.fsdp:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            tracker = FSDPMemTracker(module, optimizer)
            tracker.track_inputs((batch,))
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker = MemTracker()
            tracker.track_external(module, optimizer)
        tracker.__enter__()
        self._tracker = tracker

    def stop_tracking(self) -> None:
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(None, None, None)
        snapshot = tracker.get_tracker_snapshot("peak")
        per_device = [snap for dev, snap in snapshot.items() if str(dev) == "cpu"]
        # Category names without their enum prefix: Total, SHARDED_PARAM, ACT, OPT... (PARAM, GRAD... for DDP).
        peak = {str(k).rpartition(".")[2]: int(v) for k, v in (per_device[0] if per_device else {}).items()}
        if peak.get("Total", 0) > self.peak.get("Total", 0):  # one tracker per step; the larger peak is kept
            self.peak = peak


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch.distributed as dist
    import variants
    from contenders import build, default_sizes, lm_fsdp2_config

    common.pin_threads()
    sizes = default_sizes(args.sizes)
    out: dict[str, Any] = {}
    for name in args.configs.split(","):
        spec, overrides = CONFIGS[name]
        contender, variant = variants.split(spec)
        L.seed_everything(0, verbose=False)
        measure = Measure(fsdp=contender == "mm_fsdp2")
        with variants.behaviour(variant):
            setup = build(
                "lm",
                contender,
                sizes,
                TRACKED_STEPS[-1] + 1,
                mm_config={**lm_fsdp2_config(), **overrides} if contender == "mm_fsdp2" else None,
            )
            setup.module.optimizer_step = _closure_then_step.__get__(setup.module)  # type: ignore[method-assign]
            trainer = L.Trainer(
                strategy=setup.strategy,
                precision=setup.precision,
                max_steps=TRACKED_STEPS[-1] + 1,
                callbacks=[measure.callback],
                **common.quiet_trainer_kwargs(),
            )
            trainer.fit(setup.module, train_dataloaders=setup.loader)
        out[name] = {"bytes": measure.bytes, "peak": measure.peak}
        del trainer, setup
        gc.collect()
        dist.barrier()
    common.write_rank_json(Path(args.out), "memory", out)


def _closure_then_step(self: Any, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
    """Forward and backward first, then the optimiser step: the tracker then files each tensor under the phase
    that made it (Lightning's default runs the closure inside ``optimizer.step``). Same work, same order."""
    optimizer_closure()
    optimizer.step()


def expected_bytes(sizes_name: str) -> dict[str, Any]:
    """Exact per-rank bytes from the meta model and the plan (no processes)."""
    import torch
    from contenders import default_sizes, lm_fsdp2_config, seed_fsdp2_config
    from model import TinyVLM

    from lightning_mm import FSDP2Config
    from lightning_mm.core.memory import per_rank_memory
    from lightning_mm.core.sharding_plan import build_plan

    sizes = default_sizes(sizes_name)
    out = {}
    with torch.device("meta"):
        lm = common.DecoderLM(sizes.lm)
        vlm = TinyVLM(sizes.vlm)
    holder_lm, holder_vlm = torch.nn.Module(), torch.nn.Module()
    holder_lm.model, holder_vlm.model = lm, vlm  # paths relative to the LightningModule, as in the benchmark
    for name, holder, cfg in (("lm", holder_lm, lm_fsdp2_config()), ("vlm_seed_yaml", holder_vlm, seed_fsdp2_config())):
        for world in (2, 4, 8):
            plan = build_plan(FSDP2Config.from_dict(cfg), holder, world)
            mem = per_rank_memory(holder, plan)
            out[f"{name}/world{world}"] = {
                "params": mem.params,
                "grads": mem.grads,
                "optimizer": mem.optimizer,
                "total": mem.total,
                "ddp_total": mem.ddp_total,
                "ratio_to_ddp": mem.total / mem.ddp_total,
                "target": mem.ddp_total / world * 1.01,
                "meets_target": mem.total <= mem.ddp_total / world * 1.01,
            }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # plotting is optional (not a test dependency); the JSON results are written already
        print(f"matplotlib is not installed: no {path.name}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peaks = result["peak_per_rank"]
    names = list(peaks)
    categories = sorted({c for n in names for c in peaks[n]["by_category"] if c != "Total"})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 2.2]})
    exact = result["exact_bytes_2_ranks"]
    labels = ["params", "grads", "optimizer"]
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], [exact["ddp"][k] / 2**20 for k in labels], 0.4, label="DDP")
    ax1.bar([i + 0.2 for i in x], [exact["mm_fsdp2"][k] / 2**20 for k in labels], 0.4, label="MMFSDP2Strategy")
    ax1.set_xticks(list(x), labels)
    ax1.set_ylabel("MiB per rank (measured)")
    ax1.set_title(f"exact bytes: {exact['ratio_to_ddp']:.3f} of DDP")
    ax1.legend()
    bottom = [0.0] * len(names)
    for cat in categories:
        vals = [peaks[n]["by_category"].get(cat, 0) / 2**20 for n in names]
        if any(vals):
            ax2.bar(names, vals, bottom=bottom, label=cat.lower())
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylim(0, max(bottom) * 1.25)
    ax2.set_ylabel("tracked peak, MiB (max over ranks)")
    ax2.set_title("peak of a training step by category")
    ax2.tick_params(axis="x", rotation=30)
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = common.benchmark_parser(__doc__)
    parser.add_argument("--sizes", default="medium", help="size preset: tiny, small, medium")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--name", default="memory")
    args = common.parse_or_work(parser, worker, out="/tmp/lmm_bench/memory")
    if args is None:
        return
    out = Path(args.out)
    machine = common.machine()
    started = time.time()
    common.launch_ranks(
        Path(__file__),
        ["--worker", "--sizes", args.sizes, "--configs", args.configs, "--out", str(out)],
        log=out / "log.txt",
    )
    ranks = common.read_rank_jsons(out, "memory")
    names = args.configs.split(",")
    peak = {}
    for n in names:
        per_rank = [r[n]["peak"] for r in ranks]
        worst = max(range(len(per_rank)), key=lambda i: per_rank[i].get("Total", 0))
        peak[n] = {"total_per_rank": [p.get("Total", 0) for p in per_rank], "by_category": per_rank[worst]}
    measured = {}
    for n in ("zero3", "ddp"):
        if n in names:
            per_rank = [r[n]["bytes"] for r in ranks]
            measured["mm_fsdp2" if n == "zero3" else "ddp"] = {
                k: max(p[k] for p in per_rank) for k in ("params", "grads", "optimizer", "optimizer_step_counters")
            }
    expected = expected_bytes(args.sizes)
    result: dict[str, Any] = {
        "benchmark": "memory",
        "command": "python benchmarks/memory_bench.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "wall_s": round(time.time() - started, 1),
        "sizes": args.sizes,
        "tracked_steps": TRACKED_STEPS,
        "configs": {n: {"contender": CONFIGS[n][0], "overrides": CONFIGS[n][1]} for n in names},
        "expected_bytes": expected,
        "peak_per_rank": peak,
    }
    if {"mm_fsdp2", "ddp"} <= set(measured):
        mm, ddp = measured["mm_fsdp2"], measured["ddp"]
        total = mm["params"] + mm["grads"] + mm["optimizer"]
        ddp_total = ddp["params"] + ddp["grads"] + ddp["optimizer"]
        exp = expected["lm/world2"]
        result["exact_bytes_2_ranks"] = {
            "mm_fsdp2": mm,
            "ddp": ddp,
            "ratio_to_ddp": total / ddp_total,
            "meets_target": total <= ddp_total / 2 * 1.01,
            "measured_equals_computed": [total, ddp_total] == [exp["total"], exp["ddp_total"]],
        }
    path = common.save_result(args.name, result)
    if "exact_bytes_2_ranks" in result and peak:
        plot(result, path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k in ("exact_bytes_2_ranks", "peak_per_rank")}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
