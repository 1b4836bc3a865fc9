"""Start-up time of each ``lightning-mm`` command against ``python -c 'import torch'``.

    python benchmarks/startup.py [--rounds 7] [--out benchmarks/results/startup.json]

Each round runs every command once, in an order that rotates from round to round, as a fresh process from the
repository root; a command's figure is the median wall time over rounds, and its ratio to ``import torch`` is the
median of the per-round ratios (so drift on a shared machine falls on all of them alike). The commands that do not
train only parse or print; ``fit --print_config`` parses the demo's config (Lightning, the model and data classes)
without building a Trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "lightning_mm.cli"]

COMMANDS: dict[str, list[str]] = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "lightning-mm --help": [*CLI, "--help"],
    "lightning-mm migrate (example)": [*CLI, "migrate", "examples/migration/pretrain_custom.sh"],
    "lightning-mm convert --help": [*CLI, "convert", "--help"],
    "lightning-mm env": [*CLI, "env"],
    "lightning-mm plan (demo)": [*CLI, "plan", "--config", "examples/captioning/config.yaml"],
    "lightning-mm fit --print_config (demo)": [
        *CLI,
        "fit",
        "--print_config",
        "--config",
        "examples/captioning/config.yaml",
    ],
}
BASELINE = "python -c 'import torch'"


def time_once(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed:\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    names = list(COMMANDS)
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory():
        for name in names:  # one untimed warm-up run each (file system cache)
            time_once(COMMANDS[name], env)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(time_once(COMMANDS[name], env))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results = {}
    print(f"{'command':<42} {'median s':>9} {'x import torch':>15}  [min, max] ratio")
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times[BASELINE])]
        results[name] = {
            "seconds": times[name],
            "median_s": statistics.median(times[name]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        r = results[name]
        print(
            f"{name:<42} {r['median_s']:>9.2f} {r['ratio_median']:>15.2f}  [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}]"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"rounds": args.rounds, "load_1min_after": load, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
