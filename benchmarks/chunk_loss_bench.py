"""Chunked cross-entropy (issue #25, 5(b) and 5(c)): the loss's peak memory and its step time, against the full loss.

    OMP_NUM_THREADS=1 python benchmarks/chunk_loss_bench.py     # -> results/chunk_loss.json

Contenders, for hidden states ``h`` (tokens x hidden, requires grad) and an output weight ``w`` (vocab x hidden,
requires grad), forward and backward of the mean token cross-entropy:

* ``full``: ``cross_entropy(linear(h, w).float(), targets)``, what a Transformers model's own loss does;
* ``chunked``: :func:`lightning_mm.core.chunked_loss.linear_cross_entropy` (``enable_chunk_loss``), 1024 tokens a
  chunk;
* ``checkpointed``: the alternative, ``torch.utils.checkpoint`` around each chunk's ``linear`` + summed
  cross-entropy (its backward recomputes the chunk's logits).

(b) Peak memory: torch's ``MemTracker`` (``torch.distributed._tools``, as benchmarks/memory_bench.py uses it) follows
every tensor allocated during the loss's forward and backward and reports the peak of the live bytes, less the
inputs ``h``/``w`` themselves (their gradients count); "loss side" is that less the weight's gradient, which every
method produces (it becomes ``w.grad``). The goal: loss side <= chunk x vocab x 4 bytes + the hidden states'
bytes. At 8,192 tokens and a 151,936 vocabulary the full loss needs ~14 GB, more than this shared machine can
spare, so those sizes run under ``FakeTensorMode`` (tensors with shapes and dtypes but no storage; the tracker
counts the bytes they would take); the same tracker on real tensors at the timing sizes below gives the same byte
counts as under ``FakeTensorMode`` (checked in this run).

(c) Step time at equal tokens (real tensors, one thread): the contenders in rounds whose order rotates, each round
a warm-up step and ``--steps`` timed steps per contender; per contender and round the median step, ratios to
``full`` pair by pair within each round; reported: the median over rounds and [min, max]. Also a whole model step
(forward + backward of a 1-layer Qwen3 with the same vocabulary, with and without
``enable_chunk_loss``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from lightning_mm.core.chunked_loss import linear_cross_entropy  # noqa: E402

VOCAB = 151_936
CHUNK = 1024
CONTENDERS = ("full", "chunked", "checkpointed")


def loss_of(name: str, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    if name == "full":
        return F.cross_entropy(F.linear(h, w).float(), t)
    if name == "chunked":
        return linear_cross_entropy(h, w, t, chunk_size=chunk)
    if name == "checkpointed":
        from torch.utils.checkpoint import checkpoint

        def piece(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(F.linear(hc, w).float(), tc, reduction="sum")

        total = sum(
            checkpoint(piece, h[i : i + chunk], t[i : i + chunk], use_reentrant=False)
            for i in range(0, h.shape[0], chunk)
        )
        return total / (t != -100).sum()
    raise ValueError(name)


def _inputs(tokens: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(VOCAB, hidden, generator=g) * hidden**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, VOCAB, (tokens,), generator=g)
    return h, w, t


def tracked_peak(name: str, tokens: int, hidden: int, dtype: torch.dtype, fake: bool) -> dict[str, int]:
    """The peak live bytes of tensors allocated during forward + backward of ``name`` (MemTracker)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode() if fake else contextlib.nullcontext():
        h, w, t = (
            _inputs(tokens, hidden, dtype)
            if not fake
            else (
                torch.empty(tokens, hidden, dtype=dtype, requires_grad=True),
                torch.empty(VOCAB, hidden, dtype=dtype, requires_grad=True),
                torch.zeros(tokens, dtype=torch.long),
            )
        )
        tracker = MemTracker()
        tracker.track_external(h, w, t)  # counted from the start (else a view of them would count them later)
        with tracker:
            loss_of(name, h, w, t).backward()
        snapshot = tracker.get_tracker_snapshot("peak")
    peak = {str(k).rpartition(".")[2]: int(v) for snap in snapshot.values() for k, v in snap.items()}
    inputs = sum(x.numel() * x.element_size() for x in (h, w, t))
    hidden_bytes, weight_grad = tokens * hidden * dtype.itemsize, VOCAB * hidden * dtype.itemsize
    allocated = peak["Total"] - inputs
    return {
        "peak_allocated": allocated,
        "loss_side": allocated - weight_grad,
        "hidden_bytes": hidden_bytes,
        "weight_grad_bytes": weight_grad,
        "chunk_logits_bytes": CHUNK * VOCAB * 4,
        "full_logits_bytes": tokens * VOCAB * 4,
        "goal_bytes": CHUNK * VOCAB * 4 + hidden_bytes,
        "over_goal_bytes": allocated - weight_grad - (CHUNK * VOCAB * 4 + hidden_bytes),
    }


def _step(fn: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def time_loss(rounds: int, steps: int, tokens: int, hidden: int) -> dict[str, Any]:
    h, w, t = _inputs(tokens, hidden, torch.float32)

    def run(name: str) -> None:
        h.grad = w.grad = None
        loss_of(name, h, w, t).backward()

    return _rounds({n: (lambda n=n: run(n)) for n in CONTENDERS}, rounds, steps)


def time_model(rounds: int, steps: int, tokens: int, hidden: int) -> dict[str, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lightning_mm.hf.chunk_loss import enable_chunk_loss

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    full = Qwen3ForCausalLM(config).train()
    chunked = Qwen3ForCausalLM(config).train()
    chunked.load_state_dict(full.state_dict())
    enable_chunk_loss(chunked, CHUNK)
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
    models = {"full": full, "chunked": chunked}

    def run(name: str) -> None:
        model = models[name]
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return _rounds({n: (lambda n=n: run(n)) for n in models}, rounds, steps)


def _rounds(fns: dict[str, Any], rounds: int, steps: int) -> dict[str, Any]:
    names = list(fns)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    cpu_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fns[name]()  # warm-up
            times = [_step(fns[name]) for _ in range(steps)]
            per_round[name].append(statistics.median(x[0] for x in times))
            cpu_round[name].append(statistics.median(x[1] for x in times))
        print(f"round {r}: " + ", ".join(f"{n} {per_round[n][-1]:.3f}s" for n in names), flush=True)
    out: dict[str, Any] = {"per_round_wall_s": per_round, "per_round_cpu_s": cpu_round}
    for name in names:
        ratios = [a / b for a, b in zip(per_round[name], per_round["full"])]
        cpu_ratios = [a / b for a, b in zip(cpu_round[name], cpu_round["full"])]
        out[name] = {
            "median_wall_s": statistics.median(per_round[name]),
            "median_cpu_s": statistics.median(cpu_round[name]),
            "ratio_to_full": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "cpu_ratio_to_full": statistics.median(cpu_ratios),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the memory figures (b)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 3584], help="hidden sizes for (b)")
    parser.add_argument("--time-tokens", type=int, default=2048, help="tokens of the timed steps (c)")
    parser.add_argument("--time-hidden", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    common.pin_threads()
    result: dict[str, Any] = {"machine": common.machine(), "vocab": VOCAB, "chunk": CHUNK, "args": vars(args)}

    memory: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in args.hidden:
            for name in CONTENDERS:
                key = f"{name} {str(dtype).removeprefix('torch.')} T={args.tokens} H={hidden}"
                memory[key] = tracked_peak(name, args.tokens, hidden, dtype, fake=True)
                m = memory[key]
                print(
                    key,
                    f"allocated {m['peak_allocated'] / 2**20:.1f} MiB, loss side (less the weight's "
                    f"gradient) {m['loss_side'] / 2**20:.1f} MiB, goal {m['goal_bytes'] / 2**20:.1f} MiB "
                    f"({m['over_goal_bytes']:+,} B)",
                    flush=True,
                )
    check = {}
    for name in CONTENDERS:  # the fake-tensor byte counts against real tensors, at the timing sizes
        real = tracked_peak(name, args.time_tokens, args.time_hidden, torch.float32, fake=False)["peak_allocated"]
        fake = tracked_peak(name, args.time_tokens, args.time_hidden, torch.float32, fake=True)["peak_allocated"]
        check[name] = {"real": real, "fake": fake}
    result["memory"] = memory
    result["memory_fake_vs_real"] = check
    print("fake vs real:", check, flush=True)

    result["load_before_timing"] = common.loadavg()
    result["loss_step"] = time_loss(args.rounds, args.steps, args.time_tokens, args.time_hidden)
    result["model_step"] = time_model(args.rounds, args.steps, args.time_tokens, args.time_hidden)
    result["load_after"] = common.loadavg()
    path = common.save_result("chunk_loss", result)
    for part in ("loss_step", "model_step"):
        for name, v in result[part].items():
            if isinstance(v, dict) and "ratio_to_full" in v:
                print(
                    f"{part} {name}: {v['median_wall_s']:.3f}s wall, ratio {v['ratio_to_full']:.3f} "
                    f"{[round(x, 3) for x in v['ratio_range']]}, cpu ratio {v['cpu_ratio_to_full']:.3f}"
                )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
