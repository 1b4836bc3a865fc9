"""Markdown tables from benchmarks/results/*.json (for benchmarks/README.md).

python benchmarks/report.py                       # every result present
python benchmarks/report.py step_time tuning      # some of them
python benchmarks/report.py --plot-checkpoint     # results/checkpoint.png from results/checkpoint.json
python benchmarks/report.py --plot [NAME ...]     # PNGs of checkpoint, optimizer_step, overhead_profile
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(os.environ.get("LMM_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _machine(r: dict[str, Any]) -> str:
    m = r.get("machine", {})
    load = m.get("loadavg") or []
    after = r.get("load_after") or []
    loads = f"load {load[0]:.2f}" if load else ""
    if after:
        loads += f" -> {after[0]:.2f} after"
    return (
        f"_{m.get('date', '?')}; {m.get('nproc')} cores ({m.get('cpu')}), {m.get('mem_gib')} GiB; {loads}; "
        f"torch {m.get('torch')}, lightning {m.get('lightning')}. Command: `{r.get('command')}`_"
    )


def step_time(name: str = "step_time") -> str:
    r = _load(name)
    if r is None:
        return ""
    out = [_machine(r), ""]
    for model, s in r["summary"].items():
        comm = s.get("collectives_per_step_rank0", {})
        out += [
            f"**{model}**",
            "",
            "| contender | wall ms/step | CPU ms/step | all-gathers/step | MiB all-gathered/step | final loss |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for n, ms in s["median_step_ms"].items():
            c = comm.get(n, {})
            gathers = c.get("all_gather_single_calls", c.get("all_gather_calls"))
            gbytes = c.get("all_gather_single_bytes", c.get("all_gather_bytes"))
            out.append(
                f"| {n} | {ms:.1f} | {s['median_cpu_ms'][n]:.1f} | "
                f"{'-' if gathers is None else f'{gathers:g}'} | "
                f"{'-' if gbytes is None else _mib(gbytes)} | {s['final_loss'][n]:.4f} |"
            )
        out += ["", "| ratio (same round) | wall: median [min, max] | CPU: median [min, max] |", "|---|---|---|"]
        for pair, v in s["ratios"].items():
            c = s["cpu_ratios"][pair]
            out.append(
                f"| {pair} | **{v['median']:.3f}** [{v['min']:.3f}, {v['max']:.3f}] | "
                f"{c['median']:.3f} [{c['min']:.3f}, {c['max']:.3f}] |"
            )
        out.append("")
    return "\n".join(out)


def memory() -> str:
    r = _load("memory")
    if r is None:
        return ""
    out = [_machine(r), ""]
    e = r.get("exact_bytes_2_ranks")
    if e:
        out += [
            "| per rank, 2 ranks (measured) | params | grads | AdamW state | total | of DDP |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for n in ("ddp", "mm_fsdp2"):
            b = e[n]
            total = b["params"] + b["grads"] + b["optimizer"]
            ddp = e["ddp"]["params"] + e["ddp"]["grads"] + e["ddp"]["optimizer"]
            out.append(
                f"| {n} | {b['params']:,} B | {b['grads']:,} B | {b['optimizer']:,} B | {total:,} B | "
                f"{total / ddp:.4f} |"
            )
        out += [
            "",
            f"Measured equals computed (`per_rank_memory`): {e['measured_equals_computed']}; "
            f"target (<= 1/2 of DDP + 1%) met: {e['meets_target']}.",
            "",
        ]
    out += [
        "| model / world size (computed) | total per rank | DDP per rank | ratio | 1/N + 1% met |",
        "|---|---:|---:|---:|---|",
    ]
    for k, v in r["expected_bytes"].items():
        out.append(
            f"| {k} | {_mib(v['total'])} MiB | {_mib(v['ddp_total'])} MiB | {v['ratio_to_ddp']:.4f} | "
            f"{'yes' if v['meets_target'] else 'no'} |"
        )
    out += [
        "",
        "| config | YAML change | tracked peak per rank (MiB) | unsharded params at peak | activations | "
        "optimizer state |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for n, p in r["peak_per_rank"].items():
        cats = p["by_category"]
        cfg = r["configs"][n]
        change = ", ".join(f"`{k}: {v}`" for k, v in cfg["overrides"].items()) or (
            "(tuning undone)" if "@" in cfg["contender"] else "-"
        )
        out.append(
            f"| {n} | {change} | {_mib(max(p['total_per_rank']))} | "
            f"{_mib(cats.get('UNSHARDED_PARAM', cats.get('PARAM', 0)))} | {_mib(cats.get('ACT', 0))} | "
            f"{_mib(cats.get('OPT', 0))} |"
        )
    return "\n".join(out)


def init() -> str:
    r = _load("init")
    if r is None:
        return ""
    out = [
        _machine(r),
        "",
        f"{r['params']:,} parameters ({r['fp32_bytes'] / 2**30:.2f} GiB in fp32), 2 ranks.",
        "",
        "| mode | peak RSS rank 0 | peak RSS rank 1 | RSS before fit | local parameter bytes | build+shard+init |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, runs in r["runs"].items():
        out.append(
            f"| {mode} | {runs[0]['peak_rss'] / 2**30:.2f} GiB | {runs[1]['peak_rss'] / 2**30:.2f} GiB | "
            f"{runs[0]['baseline_rss'] / 2**30:.2f} GiB | {runs[0]['local_param_bytes'] / 2**30:.2f} GiB | "
            f"{max(x['setup_s'] for x in runs):.1f} s |"
        )
    if "peak_ratio" in r:
        out += [
            "",
            f"Peak per rank, meta / eager: **{r['peak_ratio']:.3f}** (increase over the RSS before fit: "
            f"{r['peak_increase_ratio']:.3f}); target <= 0.6 met: {r['meets_target']}.",
        ]
    return "\n".join(out)


def optimizer_step() -> str:
    r = _load("optimizer_step")
    if r is None:
        return ""
    out = [
        _machine(r),
        "",
        "| sizes | params | Tensor: default | foreach | fused | DTensor: default | foreach | fused | "
        "DTensor fused/default | max weight diff, fused vs default |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        cells = [
            f"{row[f'{kind}_{impl}_ms']} ms"
            for kind in ("tensor", "dtensor")
            for impl in ("default", "foreach", "fused")
        ]
        out.append(
            f"| {row['sizes']} | {row['params']:,} | {' | '.join(cells)} | "
            f"**{row['dtensor_fused_over_default']}** | {row['dtensor_fused_max_weight_diff']:.1e} |"
        )
    return "\n".join(out)


def checkpoint() -> str:
    r = _load("checkpoint")
    if r is None:
        return ""
    out = [
        f"{r['params']:,} parameters ({r['param_mb']:.0f} MB fp32) with AdamW state, {r['devices']} ranks, best of "
        f"{r['repeat']}.",
        "",
        "| format | save (s) | load (s) | save peak RSS increase per rank (MB) | load peak (MB) | on disk (MB) |",
        "|---|---:|---:|---|---|---:|",
    ]
    for row in r["rows"]:
        out.append(
            f"| {row['format']} | {row['save_s']:.2f} | {row['load_s']:.2f} | {row['save_peak_mb']} | "
            f"{row['load_peak_mb']} | {row['disk_mb']} |"
        )
    return "\n".join(out)


def _figure(
    name: str, ncols: int = 1, figsize: tuple[float, float] = (10, 4.5)
) -> tuple[dict[str, Any], Any, Any, Any]:
    """The result ``name`` and a fresh figure for it: ``(result, plt, fig, axes)``."""
    r = _load(name)
    if r is None:
        raise SystemExit(f"no results/{name}.json")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    return r, plt, fig, axes


def _save_figure(plt: Any, fig: Any, name: str) -> Path:
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_checkpoint() -> Path:
    """A PNG of checkpoint_bench.py's result (that script writes JSON only)."""
    r, plt, fig, (ax1, ax2) = _figure("checkpoint", ncols=2, figsize=(10, 4))
    rows = r["rows"]
    names = [row["format"] for row in rows]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [row["save_s"] for row in rows], 0.4, label="save")
    ax1.bar([i + 0.2 for i in x], [row["load_s"] for row in rows], 0.4, label="load")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("seconds (slowest rank, best of repeats)")
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [max(row["save_peak_mb"]) for row in rows], 0.4, label="save")
    ax2.bar([i + 0.2 for i in x], [max(row["load_peak_mb"]) for row in rows], 0.4, label="load")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("peak RSS increase, MB (max over ranks)")
    ax2.legend()
    fig.suptitle(f"checkpoint of {r['params'] / 1e6:.0f} M parameters + AdamW state, {r['devices']} ranks")
    return _save_figure(plt, fig, "checkpoint")


def plot_optimizer_step() -> Path:
    """A PNG of optimizer_step.py's result: ms per AdamW step by implementation, per size (log scale)."""
    r, plt, fig, ax = _figure("optimizer_step")
    rows = r["rows"]
    series = [(kind, impl) for kind in ("tensor", "dtensor") for impl in ("default", "foreach", "fused")]
    width = 0.8 / len(series)
    for i, (kind, impl) in enumerate(series):
        xs = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(rows))]
        ax.bar(
            xs,
            [row[f"{kind}_{impl}_ms"] for row in rows],
            width,
            label=f"{kind}, {impl}",
            hatch="//" if kind == "dtensor" else None,
        )
    ax.set_xticks(range(len(rows)), [f"{row['sizes']}\n{row['params'] / 1e6:.1f} M params" for row in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms per AdamW step (median)")
    ax.set_title("AdamW step over plain tensors and FSDP2 DTensors: torch's CPU default, foreach, fused")
    ax.legend(fontsize=8, ncol=2)
    return _save_figure(plt, fig, "optimizer_step")


def plot_overhead_profile() -> Path:
    """A PNG of overhead_profile.py's result: Python function calls per training step, per contender."""
    r, plt, fig, ax = _figure("overhead_profile")
    data = r["rank0"]
    models = sorted({k.split("/")[0] for k in data})
    contenders = list(dict.fromkeys(k.split("/")[1] for k in data))
    width = 0.8 / len(contenders)
    for i, name in enumerate(contenders):
        xs = [j + (i - len(contenders) / 2 + 0.5) * width for j in range(len(models))]
        ax.bar(xs, [data.get(f"{m}/{name}", {}).get("calls_per_step", 0) for m in models], width, label=name)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("Python function calls per step (rank 0, cProfile)")
    ax.set_title("per-step Python work by contender")
    ax.legend()
    return _save_figure(plt, fig, "overhead_profile")


PLOTS = {
    "checkpoint": plot_checkpoint,
    "optimizer_step": plot_optimizer_step,
    "overhead_profile": plot_overhead_profile,
}

SECTIONS = {
    "step_time": step_time,
    "step_time_vlm_pair": lambda: step_time("step_time_vlm_pair"),
    "fsdp1_pair": lambda: step_time("fsdp1_pair"),
    "tuning": lambda: step_time("tuning"),
    "tuning_module": lambda: step_time("tuning_module"),
    "memory": memory,
    "init": init,
    "optimizer_step": optimizer_step,
    "checkpoint": checkpoint,
}


def main() -> None:
    if sys.argv[1:] == ["--plot-checkpoint"]:
        print(f"wrote {plot_checkpoint()}")
        return
    if sys.argv[1:2] == ["--plot"]:  # PNGs for the results whose scripts write JSON only
        for name in sys.argv[2:] or list(PLOTS):
            print(f"wrote {PLOTS[name]()}")
        return
    for name in sys.argv[1:] or list(SECTIONS):
        text = SECTIONS[name]()
        if text:
            print(f"<!-- {name} -->\n{text}\n")


if __name__ == "__main__":
    main()
