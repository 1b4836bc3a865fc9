"""Vision data-parallel balancing (``encoder_dp_balance``) on CPU ranks: the spread of per-rank vision time and
the step time, with and without balancing, on a long-tailed image mix.

    torchrun --nproc_per_node 2 benchmarks/vision_balance_bench.py [--steps 8] [--rounds 2] [--out FILE]
    torchrun --nproc_per_node 4 benchmarks/vision_balance_bench.py ...

The model is a Qwen2.5-VL (the real Transformers class, random fp32 weights) with a vision tower that dominates
the step: tower hidden 128, 4 blocks (window attention of 112 pixels, the last block full attention), a 2-layer
text model of hidden 64. Each rank's micro-batch per step holds ``--images`` images whose patch counts follow a
Pareto law (shape ``--alpha``; ``--min-side`` merged groups a side at the least, ``--max-side`` at the most; each
image square-ish, 14-pixel patches merged 2x2), drawn from a generator seeded by step and rank, so both modes see
the same images. The model is replicated (gradients all-reduced after backward as DDP does) so that no per-layer
collective inside the tower makes the ranks wait for each other while its time is measured.

Measured per step and rank: the vision time (the tower's blocks and merger, from a forward pre-hook on its first
block to a forward hook on its merger: the encoding compute, without the exchange) and the step time (forward,
backward and the gradient all-reduce, the same on every rank since the all-reduce waits for the slowest). Per
step the spread is max/mean of the ranks' vision times. Modes: ``off`` (each rank encodes its own images) and
``on`` (``encoder_dp_balance`` with the cost model calibrated on its first 4 calls, which run as warm-up). The
modes alternate by round in the same processes; medians over the timed steps. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning_mm.hf.vision_tower_balance import balance_state, enable_vision_balance  # noqa: E402

PATCH = 3 * 2 * 14 * 14
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 5, 6, 7, 8
VOCAB = 256


def build_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    vision = dict(
        depth=4,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        out_hidden_size=64,
        fullatt_block_indexes=[3],
        window_size=112,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config).train()


def image_sides(n: int, seed: int, alpha: float, min_side: int, max_side: int) -> list[tuple[int, int]]:
    """``n`` images as (height, width) in merged 2x2 groups: area ``min_side^2 * Pareto(alpha)``, capped."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        u = float(torch.rand((), generator=g))
        area = min(min_side**2 * (1.0 - u) ** (-1.0 / alpha), max_side**2)
        h = max(min_side, min(max_side, round(area**0.5)))
        w = max(min_side, min(max_side, round(area / h)))
        out.append((h, w))
    return out


def batch(sides: list[tuple[int, int]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    row: list[int] = []
    pixels, grids = [], []
    for h, w in sides:
        grid = (1, 2 * h, 2 * w)
        row += torch.randint(10, VOCAB, (4,), generator=g).tolist() + [VISION_START] + [IMAGE_TOKEN] * (h * w)
        row.append(VISION_END)
        pixels.append(torch.randn(4 * h * w, PATCH, generator=g))
        grids.append(grid)
    row += torch.randint(10, VOCAB, (8,), generator=g).tolist()
    ids = torch.tensor([row])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100),
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.tensor(grids),
        "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
    }


class VisionTimer:
    """The time from the tower's first block to the end of its merger (forward hooks; the model is unchanged)."""

    def __init__(self, tower: Any) -> None:
        self.start = 0.0
        self.seconds = 0.0
        tower.blocks[0].register_forward_pre_hook(self._begin)
        tower.merger.register_forward_hook(self._end)

    def _begin(self, *_: Any) -> None:
        self.start = time.perf_counter()

    def _end(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self.start


def run_mode(model: Any, params: list[torch.nn.Parameter], timer: VisionTimer, args: Any, steps: range) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    records = []
    for step in steps:
        sides = image_sides(args.images, 1000 * step + rank, args.alpha, args.min_side, args.max_side)
        inputs = batch(sides, 7 * step + rank)
        timer.seconds = 0.0
        dist.barrier()
        start = time.perf_counter()
        model(**inputs).loss.backward()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad = None
        step_seconds = time.perf_counter() - start
        mine = torch.tensor([timer.seconds, step_seconds, float(sum(4 * h * w for h, w in sides))])
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        vision = [float(t[0]) for t in gathered]
        record: dict[str, Any] = {}
        state = balance_state(model.model.visual)
        if state is not None and state.last_route is not None:  # the cost model's view of this step
            route = state.last_route
            mean = sum(route.costs) / world
            record["estimated_spread"] = max(route.loads()) / mean
            record["indivisible_bound"] = max(max(route.costs), mean) / mean  # an image is never split
        records.append(
            {
                **record,
                "vision": vision,
                "spread": max(vision) / (sum(vision) / world),
                "step": max(float(t[1]) for t in gathered),
                "patches": [int(t[2]) for t in gathered],
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--images", type=int, default=6, help="images per rank and step")
    parser.add_argument("--alpha", type=float, default=1.1, help="Pareto shape of the image areas")
    parser.add_argument("--min-side", type=int, default=3, help="merged groups a side, at the least")
    parser.add_argument("--max-side", type=int, default=24, help="merged groups a side, at the most")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plain = build_model()
    balanced = build_model()
    enable_vision_balance(balanced, None, calibration_calls=4)
    timers = {"off": VisionTimer(plain.model.visual), "on": VisionTimer(balanced.model.visual)}
    models = {"off": plain, "on": balanced}
    params = {k: [p for p in m.parameters() if p.requires_grad] for k, m in models.items()}
    warm = 5
    for mode in ("off", "on"):  # warm-up (and the calibration of the cost model)
        run_mode(models[mode], params[mode], timers[mode], args, range(-warm, 0))
    results: dict[str, list] = {"off": [], "on": []}
    for r in range(args.rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for mode in order:
            steps = range(r * args.steps, (r + 1) * args.steps)
            results[mode] += run_mode(models[mode], params[mode], timers[mode], args, steps)
    state = balance_state(balanced.model.visual)
    assert state is not None
    cost = state.calibration.cost()
    summary = {
        "world": dist.get_world_size(),
        "args": vars(args),
        "cost_model": {"linear": cost.linear, "quadratic": cost.quadratic},
        "threads": torch.get_num_threads(),
    }
    for mode, records in results.items():
        summary[mode] = {
            "vision_spread_median": statistics.median(r["spread"] for r in records),
            "vision_spread_max": max(r["spread"] for r in records),
            "vision_seconds_max_median": statistics.median(max(r["vision"]) for r in records),
            "step_seconds_median": statistics.median(r["step"] for r in records),
            "owned_patch_spread_median": statistics.median(
                max(r["patches"]) / (sum(r["patches"]) / len(r["patches"])) for r in records
            ),
        }
    on = results["on"]
    summary["on"]["estimated_spread_median"] = statistics.median(r["estimated_spread"] for r in on)
    summary["on"]["indivisible_bound_median"] = statistics.median(r["indivisible_bound"] for r in on)
    summary["step_time_ratio_on_off"] = summary["on"]["step_seconds_median"] / summary["off"]["step_seconds_median"]
    if dist.get_rank() == 0:
        text = json.dumps(summary, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    # Leave without interpreter teardown: a finished gloo run can abort in it (see tests/helpers/scenario_exit.py).
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
