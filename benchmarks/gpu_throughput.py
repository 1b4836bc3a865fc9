"""Benchmark 5 (GPU): tokens/s, peak memory and MFU of MMFSDP2Strategy vs a plain FSDP2 training loop
(torchtitan's way), eager and with per-block torch.compile.

On a machine with CUDA GPUs, from the repository root, one command (its defaults are sized to end within 8 minutes
on one H200 by an estimate of its steps; no GPU run of it is recorded yet):

    python benchmarks/gpu_throughput.py           # every visible GPU -> results/gpu_throughput.json, .md (and .png)
    python benchmarks/gpu_throughput.py --nproc 8 --batch 4 --seq 2048 --rounds 3
    python benchmarks/gpu_throughput.py --no-compile          # eager only

It first runs the smoke test (benchmarks/fsdp2_smoke.py on the same GPUs; ``--skip-smoke`` to leave it out), then
the contenders, and writes one JSON and the Markdown rows for benchmarks/README.md. It installs nothing.

A ~1.1 B-parameter Llama-style decoder (RMSNorm, rotary embedding, grouped-query attention, SwiGLU; hidden 2048,
22 layers, 32 heads / 4 KV heads, MLP 5632, vocab 32000: the TinyLlama shape), bf16 parameters for compute and
fp32 gradient reduction, every block an FSDP unit, AdamW (fused), random tokens. Both contenders run inside the
same torchrun processes, alternating in rounds, with the same model, initialisation, data and optimiser:

* ``plain``: ``fully_shard`` on each block (the last one not resharded after forward) and on the model, meta-device
  init, and a hand-written loop: forward, cross-entropy, backward, optimizer step, zero_grad.
* ``mm_fsdp2``: a LightningModule whose ``configure_model`` builds the same model, trained by ``Trainer`` with
  ``MMFSDP2Strategy`` and the YAML ``{sharding_size: auto, sub_modules_to_wrap: [model.layers.{*}],
  param_dtype: bf16, reduce_dtype: fp32}``.
* ``plain_compiled`` / ``mm_fsdp2_compiled``: the same, each block's forward compiled by ``torch.compile``
  (``fullgraph=True``, ``--compile-backend``, default inductor) before ``fully_shard``; for the strategy that is
  the YAML's ``compile_modules: [model.layers.{*}]``.

With 2 or more processes (an even number), two more contenders (``--no-cp`` leaves them out), the Transformers
``LlamaForCausalLM`` of the same shape (sdpa attention) built by ``MMTransformersModule`` (meta device, the project's
init) with the same mixed precision and wrapping:

* ``mm_hf``: each rank trains its own ``batch`` sequences of ``seq`` tokens (as the others);
* ``mm_hf_ring_cp2``: ``context_parallel_size: 2, context_parallel_algo: kv_allgather`` (MindSpeed MM's
  ``megatron_cp_algo``): each pair of ranks shares ``batch`` sequences of ``2 x seq`` tokens (zig-zag chunks, keys
  and values all-gathered over the pair). Tokens per GPU and step are the same as every other contender's, over
  sequences twice as long: ``ratio_ring_cp2_to_hf`` is what context parallelism costs for them (more attention per
  token, the key/value all-gather and its reduce-scatter). Its MFU counts the FLOPs of ``2 x seq`` sequences.

Throughput is measured over the timed steps between two ``torch.cuda.synchronize()`` calls. MFU comes from the
FLOP counter that ``MMLightningModule`` logs ``train/mfu`` with (``lightning_mm.hf.transformers_flops.FlopCounter`` on
the Transformers ``LlamaConfig`` of the same shape: every matmul of forward and backward, the output layer included,
attention over the whole sequence without halving for causality, as torchtitan counts it) and the dense bf16 peak
of ``lightning_mm.core.flop_formulas.PEAK_TFLOPS`` for the device name (H100, H200, B200, A100; ``--peak-tflops`` to
override, and for any other device). Target: mm_fsdp2 >= 0.98 x plain.

``--device cpu --tiny`` runs the same code on 2 CPU processes with a tiny model (a check of the script only; its
numbers mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


# -------------------------------------------------------------------------------------------------- model
@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_layers: int = 22
    num_heads: int = 32
    num_kv_heads: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def num_params(self, embedding: bool = True) -> int:
        h, kv = self.hidden_size, self.hidden_size // self.num_heads * self.num_kv_heads
        block = 2 * h + h * h + 2 * h * kv + h * h + 3 * h * self.intermediate_size
        emb = 2 * self.vocab_size * h if embedding else 0
        return self.num_layers * block + h + emb


def flops_per_step(cfg: LlamaConfig, batch: int, seq: int) -> int:
    """Model FLOPs of one training step of one GPU (``batch`` sequences of ``seq`` tokens), from the project's
    counter on the Transformers config of this model's shape (untied output layer, SwiGLU, grouped-query heads)."""
    import torch
    import transformers

    from lightning_mm.hf.transformers_flops import FlopCounter

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        tie_word_embeddings=False,
    )
    return FlopCounter(config)({"input_ids": torch.zeros(batch, seq, dtype=torch.long)}).model


TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)


def _build_model(cfg: LlamaConfig) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float) -> None:
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def reset_parameters(self) -> None:
            nn.init.ones_(self.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return normed.type_as(x) * self.weight

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)

    class LlamaBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_heads
            self.hd = hd
            self.attn_norm = RMSNorm(h, cfg.norm_eps)
            self.wq = nn.Linear(h, cfg.num_heads * hd, bias=False)
            self.wk = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
            self.wv = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
            self.wo = nn.Linear(cfg.num_heads * hd, h, bias=False)
            self.mlp_norm = RMSNorm(h, cfg.norm_eps)
            self.w1 = nn.Linear(h, cfg.intermediate_size, bias=False)
            self.w3 = nn.Linear(h, cfg.intermediate_size, bias=False)
            self.w2 = nn.Linear(cfg.intermediate_size, h, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            y = self.attn_norm(x)
            q = self.wq(y).view(b, s, cfg.num_heads, self.hd).transpose(1, 2)
            k = self.wk(y).view(b, s, cfg.num_kv_heads, self.hd).transpose(1, 2)
            v = self.wv(y).view(b, s, cfg.num_kv_heads, self.hd).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(attn.transpose(1, 2).reshape(b, s, -1))
            y = self.mlp_norm(x)
            return x + self.w2(F.silu(self.w1(y)) * self.w3(y))

    class LlamaLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(LlamaBlock() for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

        def init_weights(self) -> None:
            """Normal(0, 0.02) for linear and embedding weights, ones for the norms (works on DTensor shards)."""
            with torch.no_grad():
                for m in self.modules():
                    if isinstance(m, (nn.Linear, nn.Embedding)):
                        nn.init.normal_(m.weight, std=0.02)
                    elif isinstance(m, RMSNorm):
                        nn.init.ones_(m.weight)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            s = ids.shape[1]
            hd = cfg.hidden_size // cfg.num_heads
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=ids.device, dtype=torch.float32) / hd))
            freqs = torch.outer(torch.arange(s, device=ids.device, dtype=torch.float32), inv)
            emb = torch.cat([freqs, freqs], dim=-1)
            x = self.embed(ids)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.head(self.norm(x))

    return LlamaLM()


def _loss(model: Any, ids: Any) -> Any:
    import torch.nn.functional as F

    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


# ------------------------------------------------------------------------------------------ contenders
def _batches(cfg: LlamaConfig, n: int, batch: int, seq: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, batch, seq + 1), generator=g)


def run_plain(
    cfg: LlamaConfig, args: argparse.Namespace, device: Any, data: Any, compiled: bool = False
) -> dict[str, Any]:
    """A torchtitan-style FSDP2 loop: shard each block (not the last after forward), then the root; init on meta."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),))
    with torch.device("meta"):
        model = _build_model(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        if compiled:
            layer.forward = torch.compile(layer.forward, backend=args.compile_backend, fullgraph=True)
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    times = []
    for step, batch in enumerate(data):
        if step == args.warmup:
            _sync(device)
            start = time.perf_counter()
        ids = batch.to(device, non_blocking=True)
        loss = _loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(device)
    times.append(time.perf_counter() - start)
    out = {"elapsed_s": times[0], "final_loss": float(loss), "peak_mem": _peak_mem(device)}
    del model, optimizer
    return out


def run_mm(
    cfg: LlamaConfig, args: argparse.Namespace, device: Any, data: Any, compiled: bool = False
) -> dict[str, Any]:
    """The same model, data and optimiser through Trainer + MMFSDP2Strategy."""
    import lightning as L
    import torch

    from lightning_mm import MMFSDP2Strategy

    class LlamaTask(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = _build_model(cfg)

        def init_weights(self) -> None:
            self.model.init_weights()

        def training_step(self, batch: Any, idx: int) -> Any:
            return _loss(self.model, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=device.type == "cuda")

    timing: dict[str, float] = {}

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if idx == args.warmup:
                _sync(device)
                timing["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            if idx == len(data) - 1:
                _sync(device)
                timing["end"] = time.perf_counter()
                timing["loss"] = float(outputs["loss"] if isinstance(outputs, dict) else outputs)

    torch.manual_seed(0)
    config = {
        "sharding_size": "auto",
        "sub_modules_to_wrap": ["model.layers.{*}"],
        "param_dtype": "bf16",
        "reduce_dtype": "fp32",
    }
    if compiled:
        config.update(compile_modules=["model.layers.{*}"], compile_backend=args.compile_backend)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=MMFSDP2Strategy(config),
        max_steps=len(data),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Timer()],
    )  # data is already per rank
    loader = torch.utils.data.DataLoader(list(data), batch_size=None, shuffle=False, pin_memory=device.type == "cuda")
    trainer.fit(LlamaTask(), train_dataloaders=loader)
    out = {"elapsed_s": timing["end"] - timing["start"], "final_loss": timing["loss"], "peak_mem": _peak_mem(device)}
    del trainer
    return out


def run_mm_hf(
    cfg: LlamaConfig, args: argparse.Namespace, device: Any, data: Any, compiled: bool = False, cp: int = 1
) -> dict[str, Any]:
    """The Transformers Llama of the same shape through MMTransformersModule + MMFSDP2Strategy; ``cp`` 2: ring
    (KV all-gather) context parallelism over rank pairs, ``data`` then the pair's sequences of twice the length."""
    import lightning as L
    import torch

    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.modules.transformers_module import MMTransformersModule

    hf_config = {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": max(4096, 2 * args.seq + 2),
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
    }
    timing: dict[str, float] = {}

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if idx == args.warmup:
                _sync(device)
                timing["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            if idx == len(data) - 1:
                _sync(device)
                timing["end"] = time.perf_counter()
                timing["loss"] = float(outputs["loss"] if isinstance(outputs, dict) else outputs)

    torch.manual_seed(0)
    config: dict[str, Any] = {
        "sharding_size": "auto",
        "sub_modules_to_wrap": ["model.layers.{*}"],
        "param_dtype": "bf16",
        "reduce_dtype": "fp32",
    }
    if cp > 1:
        config.update(context_parallel_size=cp, context_parallel_algo="kv_allgather")
    module = MMTransformersModule({"hf_config": hf_config}, lr=3e-4, log_grad_norm=False)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=MMFSDP2Strategy(config),
        max_steps=len(data),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Timer()],
    )  # data is already per rank (the same on both ranks of a context-parallel pair)
    batches = [{"input_ids": ids[:, :-1].clone(), "labels": ids[:, :-1].clone()} for ids in data]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False, pin_memory=device.type == "cuda")
    trainer.fit(module, train_dataloaders=loader)
    out = {"elapsed_s": timing["end"] - timing["start"], "final_loss": timing["loss"], "peak_mem": _peak_mem(device)}
    del trainer, module
    return out


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mem(device: Any) -> int | None:
    import torch

    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(peak)


# ------------------------------------------------------------------------------------------------ worker
def contenders(args: argparse.Namespace, world: int) -> list[str]:
    eager = ["plain", "mm_fsdp2"]
    names = eager if args.no_compile else [*eager, "plain_compiled", "mm_fsdp2_compiled"]
    if not args.no_cp and world >= 2 and world % 2 == 0:
        names += ["mm_hf", "mm_hf_ring_cp2"]
    return names


def tokens_per_sequence(name: str, seq: int) -> int:
    """The length of the sequences a contender trains: twice ``seq`` for the context-parallel pair."""
    return 2 * seq if name == "mm_hf_ring_cp2" else seq


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        common.pin_threads()
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
    )
    cfg = TINY if args.tiny else LlamaConfig()
    world = dist.get_world_size()
    # Each rank its own slice of the same global stream of batches.
    data = _batches(cfg, args.warmup + args.steps, args.batch, args.seq, seed=1000 + dist.get_rank())
    # The ring contender: the two ranks of a pair share their sequences, twice as long.
    ring_data = _batches(cfg, args.warmup + args.steps, args.batch, 2 * args.seq, seed=2000 + dist.get_rank() // 2)
    names = contenders(args, world)
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rnd in range(args.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]  # rotating, so drift falls on all alike
        for name in order:
            if name == "mm_hf":
                result = run_mm_hf(cfg, args, device, data)
            elif name == "mm_hf_ring_cp2":
                result = run_mm_hf(cfg, args, device, ring_data, cp=2)
            else:
                run = run_plain if name.startswith("plain") else run_mm
                result = run(cfg, args, device, data, compiled=name.endswith("_compiled"))
            result["round"] = rnd
            records[name].append(result)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
    info = {
        "world": world,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "config": asdict(cfg),
        "records": records,
    }
    common.write_rank_json(Path(args.out), "gpu_throughput", info)


def summarize(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    info = ranks[0]
    cfg = LlamaConfig(**info["config"])
    world = info["world"]
    tokens = args.steps * args.batch * args.seq * world  # global tokens in the timed steps
    from lightning_mm.core.flop_formulas import peak_tflops

    step_flops = flops_per_step(cfg, args.batch, args.seq)  # per GPU
    flops_per_token = step_flops / (args.batch * args.seq)
    peak = args.peak_tflops or peak_tflops(info["device_name"])
    out: dict[str, Any] = {
        "device_name": info["device_name"],
        "world": world,
        "params": cfg.num_params(),
        "flops_per_step_per_gpu": step_flops,
        "flops_per_token": flops_per_token,
        "peak_tflops_per_gpu": peak,
        "contenders": {},
    }
    per_round: dict[str, list[float]] = {}
    for name in contenders(args, world):
        length = tokens_per_sequence(name, args.seq)
        per_token = (
            flops_per_token if length == args.seq else flops_per_step(cfg, args.batch, length) / (args.batch * length)
        )
        elapsed = [max(r["records"][name][i]["elapsed_s"] for r in ranks) for i in range(args.rounds)]
        tps = [tokens / e for e in elapsed]
        per_round[name] = tps
        med = common.median(tps)
        out["contenders"][name] = {
            "tokens_per_s": med,
            "tokens_per_s_per_gpu": med / world,
            "per_round_tokens_per_s": tps,
            "seq": length,
            "flops_per_token": per_token,
            "tflops_per_gpu": med / world * per_token / 1e12,
            "mfu": (med / world * per_token / (peak * 1e12)) if peak else None,
            "peak_mem_gib": [
                r["records"][name][-1]["peak_mem"] / 2**30 if r["records"][name][-1]["peak_mem"] else None
                for r in ranks
            ],
            "final_loss": ranks[0]["records"][name][-1]["final_loss"],
        }

    def ratio(a: str, b: str) -> dict[str, Any]:
        pairs = [x / y for x, y in zip(per_round[a], per_round[b])]
        return {"median": common.median(pairs), "per_round": pairs}

    out["ratio_mm_to_plain"] = ratio("mm_fsdp2", "plain")
    out["meets_target"] = out["ratio_mm_to_plain"]["median"] >= 0.98
    if not args.no_compile:
        out["ratio_mm_to_plain_compiled"] = ratio("mm_fsdp2_compiled", "plain_compiled")
        out["compile_speedup_mm"] = ratio("mm_fsdp2_compiled", "mm_fsdp2")
        out["compile_speedup_plain"] = ratio("plain_compiled", "plain")
    if "mm_hf_ring_cp2" in per_round:
        out["ratio_ring_cp2_to_hf"] = ratio("mm_hf_ring_cp2", "mm_hf")
    return out


def markdown_rows(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """The rows benchmarks/README.md records: one per contender, then the ratios."""
    head = (
        f"{summary['device_name']} x{summary['world']}, {summary['params'] / 1e9:.2f} B params, bf16, "
        f"batch {args.batch} x seq {args.seq} per GPU, {args.rounds} rounds of {args.steps} steps"
    )
    rows = [
        f"**{head}**",
        "",
        "| contender | tokens/s/GPU (median) | TFLOP/s/GPU | MFU | peak memory, rank 0 (GiB) |",
        "|---|---|---|---|---|",
    ]
    for name, c in summary["contenders"].items():
        mfu = f"{c['mfu']:.1%}" if c["mfu"] is not None else "-"
        mem = f"{c['peak_mem_gib'][0]:.1f}" if c["peak_mem_gib"][0] is not None else "-"
        tflops = f"{c['tflops_per_gpu']:.1f}"
        rows.append(f"| {name} | {c['tokens_per_s_per_gpu']:,.0f} | {tflops} | {mfu} | {mem} |")
    rows.append("")
    keys = ("ratio_mm_to_plain", "ratio_mm_to_plain_compiled", "compile_speedup_mm", "compile_speedup_plain")
    for key in (*keys, "ratio_ring_cp2_to_hf"):
        if key in summary:
            r = summary[key]
            rows.append(f"- {key}: {r['median']:.3f} [{min(r['per_round']):.3f}, {max(r['per_round']):.3f}]")
    return "\n".join(rows) + "\n"


def smoke(nproc: int, out: Path) -> None:
    """benchmarks/fsdp2_smoke.py on the same GPUs; a failure ends the benchmark with its output."""
    import subprocess

    script = Path(__file__).resolve().parent / "fsdp2_smoke.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--accelerator", "cuda", "--devices", str(nproc), "--out", str(out / "smoke")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout[-2000:])
    if proc.returncode != 0:
        raise SystemExit(f"the smoke test failed (exit {proc.returncode}); not benchmarking:\n{proc.stderr[-4000:]}")


def plot(summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the `bench` extra; the JSON and Markdown rows do not need it
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(summary["contenders"])
    for i, name in enumerate(names):
        vals = summary["contenders"][name]["per_round_tokens_per_s"]
        ax.scatter([i] * len(vals), vals, color="k", s=12, zorder=3)
        ax.bar(i, summary["contenders"][name]["tokens_per_s"], 0.5)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens/s (all GPUs)")
    r = summary["ratio_mm_to_plain"]["median"]
    ax.set_title(f"{summary['device_name']} x{summary['world']}: mm_fsdp2/plain = {r:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = common.benchmark_parser(__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: visible GPUs, or 2 on CPU)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU and step")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU, for the MFU")
    parser.add_argument("--tiny", action="store_true", help="tiny model (a check of the script)")
    parser.add_argument("--name", default="gpu_throughput")
    parser.add_argument("--no-compile", action="store_true", help="eager contenders only")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled ones")
    parser.add_argument("--skip-smoke", action="store_true", help="leave out the smoke test that runs first")
    parser.add_argument("--no-cp", action="store_true", help="leave out the Transformers and ring-CP contenders")
    args = common.parse_or_work(parser, worker, out="/tmp/lmm_bench/gpu")
    if args is None:
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU is visible; this benchmark needs one (or use --device cpu --tiny to check it)")
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    flags = ("tiny", "no_compile", "no_cp")
    passthrough = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("worker", "nproc", "name", "peak_tflops", "skip_smoke", *flags) and v is not None
    ]
    passthrough += [f"--{k.replace('_', '-')}" for k in flags if getattr(args, k)]
    out = Path(args.out)
    machine = common.machine()
    if args.device == "cuda" and not args.skip_smoke:
        smoke(nproc, out)
    common.launch_ranks(Path(__file__), ["--worker", *passthrough], nproc=nproc, log=out / "log.txt")
    summary = summarize(common.read_rank_jsons(out, "gpu_throughput", nproc), args)
    result = {
        "benchmark": "gpu_throughput",
        "command": "python benchmarks/gpu_throughput.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "batch_per_gpu": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "summary": summary,
    }
    path = common.save_result(args.name, result)
    rows = markdown_rows(summary, args)
    path.with_suffix(".md").write_text(rows)
    plot(summary, path.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    print(rows)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    if not math.isfinite(summary["ratio_mm_to_plain"]["median"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
