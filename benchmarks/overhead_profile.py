"""Per-step Python work of each contender, counted (not timed): a load-independent view of per-step overhead.

    python benchmarks/overhead_profile.py             # -> results/overhead_profile.json

The step-time contenders of ``contenders.py`` (small sizes) run 16 steps each on 2 ranks; rank 0 profiles steps
6-15 with cProfile and records the Python function calls per step (deterministic for a given code path) and the
calls of the costliest functions by own time, including the collectives. Timings under cProfile are inflated and
are not reported as results.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

PROFILED = range(5, 15)


def _profile_callback() -> Any:
    import lightning as L

    class Profile(L.Callback):
        """cProfile over the batches in ``PROFILED``."""

        def __init__(self) -> None:
            self.profiler = cProfile.Profile()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if idx == PROFILED[0]:
                self.profiler.enable()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            if idx == PROFILED[-1]:
                self.profiler.disable()

    return Profile


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    from contenders import build, default_sizes

    common.pin_threads()
    sizes = default_sizes(args.sizes)
    Profile = _profile_callback()  # noqa: N806
    out: dict[str, Any] = {}
    for model in args.models.split(","):
        for name in args.contenders.split(","):
            profile = Profile()
            L.seed_everything(0, verbose=False)
            setup = build(model, name, sizes, PROFILED[-1] + 2)
            trainer = L.Trainer(
                strategy=setup.strategy,
                precision=setup.precision,
                max_steps=PROFILED[-1] + 2,
                callbacks=[profile],
                **common.quiet_trainer_kwargs(),
            )
            trainer.fit(setup.module, train_dataloaders=setup.loader)
            stats = pstats.Stats(profile.profiler)
            steps = len(PROFILED)
            top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]  # by own time
            out[f"{model}/{name}"] = {
                "calls_per_step": stats.total_calls / steps,
                "primitive_calls_per_step": stats.prim_calls / steps,
                "top_by_own_time": [
                    {"function": f"{Path(f).name}:{line}({fn})", "calls_per_step": v[1] / steps}
                    for (f, line, fn), v in top
                ],
            }
    if common.rank() == 0:
        common.write_rank_json(Path(args.out), "overhead", out)


def main() -> None:
    parser = common.benchmark_parser(__doc__)
    parser.add_argument("--models", default="lm,vlm")
    parser.add_argument("--contenders", default="mm_fsdp2,hand_fsdp2,fsdp1,ddp")
    parser.add_argument("--sizes", default="small")
    args = common.parse_or_work(parser, worker, out="/tmp/lmm_bench/overhead")
    if args is None:
        return
    out = Path(args.out)
    machine = common.machine()
    common.launch_ranks(
        Path(__file__),
        [
            "--worker",
            "--models",
            args.models,
            "--contenders",
            args.contenders,
            "--sizes",
            args.sizes,
            "--out",
            str(out),
        ],
        log=out / "log.txt",
    )
    data = json.loads((out / "overhead.rank0.json").read_text())
    result = {
        "benchmark": "overhead_profile",
        "command": "python benchmarks/overhead_profile.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "sizes": args.sizes,
        "profiled_steps": [PROFILED[0], PROFILED[-1]],
        "rank0": data,
    }
    path = common.save_result("overhead_profile", result)
    for key, v in data.items():
        print(f"{key:24} {v['calls_per_step']:10.0f} Python calls/step")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
