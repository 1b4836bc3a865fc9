"""Packed token-budget batches vs padded batches: pad share and target tokens trained per second (one CPU rank).

    python benchmarks/packing_bench.py [--samples 96] [--rounds 2] [--batch 4] [--max-len 1024]  # results/packing.json

The same model (a random Qwen2.5-VL built locally by ``TransformersModel``: the real Transformers class, sdpa,
fp32, AdamW) trains one epoch of the same samples twice per round, order rotating:

* ``padded``: ``--batch`` samples per step in a seeded shuffled order, right-padded to the longest
  (``ChatCollator``, MindSpeed MM's collator);
* ``packed``: token-budget batches (``plan_batches``, buffer 64, seed 0) of at most ``--budget`` tokens (default
  ``--max-len``, the longest sample: a packed step then holds no more than a padded one), packed into one row
  without padding (``PackedCollator``; per-sample M-RoPE positions and block-diagonal attention from
  ``TransformersModel``).

The samples are a long-tailed mix drawn from a seeded generator (see :func:`draw_samples`): 75 % short captions
(one 56x56 or 112x112 image: 4 or 16 image tokens; a 6-16 token prompt and a log-normal 4-80 token answer) and 25 %
multi-turn records (1-3 images of 112x112, 224x224, 112x224 or 336x336 pixels: 16, 64, 32 or 144 tokens; 2-6 turns,
log-normal answers of 10-400 tokens), cut to ``--max-len``; only the answers are targets. A step is forward,
backward and the optimiser step, timed with ``time.perf_counter``; each contender's epoch starts after 2 warm-up
steps of its own. Reported: the share of pad tokens among the tokens the model ran, target tokens per second, and
their ratio (packed / padded), per round and the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from lightning_mm.core.packed_rows import IGNORE_INDEX, PackedCollator  # noqa: E402
from lightning_mm.core.token_budget_plan import plan_batches  # noqa: E402
from lightning_mm.hf.chat_collate import ChatCollator  # noqa: E402

VOCAB = 4096
IMAGE, VISION_START, VISION_END = 5, 7, 8
PATCH = 3 * 2 * 14 * 14
CAPTION_GRIDS = ((1, 4, 4), (1, 8, 8))
RECORD_GRIDS = ((1, 8, 8), (1, 16, 16), (1, 8, 16), (1, 24, 24))
WARMUP = 2


def _hf_config() -> dict[str, Any]:
    return dict(
        model_type="qwen2_5_vl",
        image_token_id=IMAGE,
        video_token_id=6,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        attn_implementation="sdpa",
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            pad_token_id=0,
            use_cache=False,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=128,
            fullatt_block_indexes=[1],
            window_size=112,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
    )


def _lognormal(g: torch.Generator, median: float, sigma: float, low: int, high: int) -> int:
    value = median * float(torch.exp(torch.randn((), generator=g) * sigma))
    return int(min(max(round(value), low), high))


def _pick(g: torch.Generator, options: tuple) -> Any:
    return options[int(torch.randint(len(options), (), generator=g))]


def _sample(g: torch.Generator, parts: list[tuple[str, Any]], max_len: int) -> dict[str, torch.Tensor]:
    """Tokens from ``parts``: ``("text", n)``, ``("answer", n)`` (targets) or ``("image", grid)``; cut to fit."""
    ids: list[int] = []
    targets: list[bool] = []
    grids: list[tuple[int, int, int]] = []
    for kind, value in parts:
        if kind == "image":
            tokens = value[0] * value[1] * value[2] // 4
            if len(ids) + tokens + 2 > max_len:
                break
            ids += [VISION_START, *[IMAGE] * tokens, VISION_END]
            targets += [False] * (tokens + 2)
            grids.append(value)
            continue
        n = min(value, max_len - len(ids))
        ids += torch.randint(10, VOCAB, (n,), generator=g).tolist()
        targets += [kind == "answer"] * n
        if len(ids) >= max_len:
            break
    input_ids = torch.tensor(ids)
    labels = torch.where(torch.tensor(targets), input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    sample = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "mm_token_type_ids": (input_ids == IMAGE).long(),
    }
    if grids:
        sample["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in grids), PATCH, generator=g)
        sample["image_grid_thw"] = torch.tensor(grids)
    return sample


def draw_samples(n: int, max_len: int, seed: int = 2026) -> list[dict[str, torch.Tensor]]:
    """The long-tailed mix of the module docstring, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        if float(torch.rand((), generator=g)) < 0.75:  # a short caption
            parts = [
                ("text", 3),
                ("image", _pick(g, CAPTION_GRIDS)),
                ("text", int(torch.randint(6, 17, (), generator=g))),
                ("answer", _lognormal(g, 20, 0.6, 4, 80)),
            ]
        else:  # a multi-turn record with 1-3 images in its first turns
            images = int(torch.randint(1, 4, (), generator=g))
            parts = []
            for turn in range(int(torch.randint(2, 7, (), generator=g))):
                if turn < images:
                    parts.append(("image", _pick(g, RECORD_GRIDS)))
                parts += [
                    ("text", int(torch.randint(10, 61, (), generator=g))),
                    ("answer", _lognormal(g, 120, 0.7, 10, 400)),
                ]
        samples.append(_sample(g, parts, max_len))
    return samples


def _batches(samples: list[dict], kind: str, args: argparse.Namespace) -> list[tuple[dict, int, int, int]]:
    """``(batch, tokens run, pad tokens, target tokens)`` for one epoch of ``kind``."""
    out = []
    if kind == "padded":
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
        groups = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
        collate: Any = ChatCollator(pad_token_id=0)
    else:
        lengths = [len(s["input_ids"]) for s in samples]
        groups = plan_batches(lengths, args.budget, 64, seed=0, epoch=0, packing=True)
        collate = PackedCollator()
    for group in groups:
        batch = collate([samples[i] for i in group])
        real = sum(len(samples[i]["input_ids"]) for i in group)
        ran = batch["input_ids"].numel()
        targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        out.append((batch, ran, ran - real, targets))
    return out


def _epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list) -> float:
    def step(batch: dict) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()

    for batch, *_ in batches[:WARMUP]:
        step(batch)
    start = time.perf_counter()
    for batch, *_ in batches:
        step(batch)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=int, default=None, help="max tokens per packed row (default: --max-len)")
    args = parser.parse_args()
    args.budget = args.budget or args.max_len
    torch.set_num_threads(args.threads)
    from lightning_mm.hf.transformers_model import TransformersModel

    samples = draw_samples(args.samples, args.max_len)
    lengths = [len(s["input_ids"]) for s in samples]
    plans = {kind: _batches(samples, kind, args) for kind in ("padded", "packed")}
    torch.manual_seed(0)
    model = TransformersModel({"hf_config": _hf_config()}).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    load_before = common.loadavg()
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = ("padded", "packed") if r % 2 == 0 else ("packed", "padded")
        seconds = {kind: _epoch(model, optimizer, plans[kind]) for kind in order}
        rounds.append(seconds)
        print(f"round {r}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()), flush=True)
    result: dict[str, Any] = {
        "machine": common.machine(),
        "load_before": load_before,
        "load_after": common.loadavg(),
        "args": vars(args),
        "samples": {
            "count": len(samples),
            "tokens": sum(lengths),
            "min": min(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
            "images": sum(len(s.get("image_grid_thw", [])) for s in samples),
        },
    }
    for kind, batches in plans.items():
        ran, pads, targets = (sum(b[i] for b in batches) for i in (1, 2, 3))
        rates = [targets / rnd[kind] for rnd in rounds]
        result[kind] = {
            "steps": len(batches),
            "tokens_run": ran,
            "pad_tokens": pads,
            "pad_share": pads / ran,
            "target_tokens": targets,
            "epoch_seconds": [rnd[kind] for rnd in rounds],
            "target_tokens_per_s": rates,
            "median_target_tokens_per_s": statistics.median(rates),
        }
    result["packed"]["budget_fill"] = result["packed"]["tokens_run"] / (len(plans["packed"]) * args.budget)
    ratios = [r["padded"] / r["packed"] for r in rounds]  # same targets: the speed-up is the time ratio
    result["speedup_per_round"] = ratios
    result["speedup_median"] = statistics.median(ratios)
    path = common.save_result("packing", result)
    print(
        f"pad share: padded {result['padded']['pad_share']:.1%}, packed {result['packed']['pad_share']:.1%}; "
        f"target tokens/s: padded {result['padded']['median_target_tokens_per_s']:.0f}, packed "
        f"{result['packed']['median_target_tokens_per_s']:.0f}; speed-up {result['speedup_median']:.2f}x "
        f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}) -> {path}"
    )


if __name__ == "__main__":
    main()
