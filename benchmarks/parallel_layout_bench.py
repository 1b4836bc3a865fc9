"""Tensor parallelism on 4 CPU ranks: per-rank parameter bytes, activation bytes of the tensor-parallel layers and step
time, TP 2 x FSDP 2 against FSDP2 alone.

    python benchmarks/parallel_layout_bench.py [OUT.json]
    LAYOUT_BENCH_ROUNDS=3 LAYOUT_BENCH_STEPS=24 python benchmarks/parallel_layout_bench.py   # the defaults

A small random Qwen3 (real Transformers class, fp32: 4 layers, hidden 256, MLP 1024, 8 heads / 4 key/value heads of
32, vocab 512, untied output layer, sdpa), saved once and trained through ``TransformersModel`` with
``Trainer(accelerator="cpu", devices=4)`` (gloo), one compute thread per rank, one sequence of 256 tokens per
data-parallel rank and step, in two settings one after the other in the same processes, ``LAYOUT_BENCH_ROUNDS``
times in turn:

* ``FSDP2``: ``sharding_size: auto``: every parameter sharded over the 4 ranks; 4 data-parallel ranks;
* ``TP2 x FSDP2``: ``tensor_parallel_size: 2``: the model's own ``base_model_tp_plan`` (q/k/v/gate/up column-wise,
  o/down row-wise) over consecutive rank pairs, then ``fully_shard`` over the 2 data-parallel ranks; the embeddings,
  norms and output layer are replicated over the ``tp`` pair and sharded over the 2 ``dp`` ranks.

Measured, per setting, on the largest rank: the bytes of the parameter storage each rank holds after sharding (the
local shards), in all and of the tensor-parallel layers (``self_attn`` and ``mlp`` of every decoder layer); the
bytes autograd saves for backward inside those layers during one forward (each storage once, through
``torch.autograd.graph.saved_tensors_hooks``; parameters and their gathered copies left out); the median step time
(wall, slowest rank) over every round's steps after the first ``WARMUP``, and from it the tokens per second of the
whole run (FSDP2 trains 4 sequences per step, TP 2 x FSDP 2 trains 2: one per data-parallel rank).

Expected: parameters of the tensor-parallel layers 1/4 per rank in both settings (1/2 x 1/2, or 1/4 by FSDP alone
on 4 ranks); the replicated rest 1/2 per rank under TP 2 (against 1/4), so the whole model's bytes per rank are a bit
above FSDP2's; activations of the tensor-parallel layers at most 1/2 plus what the column-wise layers keep of their
whole input (the hidden states, replicated without sequence parallelism). Not a test: nothing here is asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STEPS = int(os.environ.get("LAYOUT_BENCH_STEPS", "24"))
ROUNDS = int(os.environ.get("LAYOUT_BENCH_ROUNDS", "3"))
WARMUP, DEVICES, SEQ = 4, 4, 256
CONFIG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
SETTINGS: dict[str, dict[str, Any]] = {
    "FSDP2": {},
    "TP2 x FSDP2": {"tensor_parallel_size": 2},
}
TP_LAYERS = ("self_attn", "mlp")


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2 * STEPS * DEVICES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(10, CONFIG["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the local parameter shards: all of them, and those inside the tensor-parallel layers."""
    total = inside = 0
    for name, p in model.named_parameters():
        n = _local(p).numel() * p.element_size()
        total += n
        if any(f".{layer}." in f".{name}" for layer in TP_LAYERS):
            inside += n
    return total, inside


class SavedInside:
    """Bytes autograd saves while a tensor-parallel layer runs (each storage once, the layer's parameters out)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.active: list[set[int]] = []
        self.seen: dict[int, int] = {}
        self.handles = []
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TP_LAYERS and ".layers." in f".{name}":
                self.handles.append(module.register_forward_pre_hook(self._enter))
                self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self.active.append({_local(p).untyped_storage().data_ptr() for p in module.parameters()})

    def _leave(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self.active.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in self.active[-1]:
                self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    def close(self) -> int:
        for h in self.handles:
            h.remove()
        return sum(self.seen.values())


def run(setting: str, ckpt: Path) -> dict[str, Any]:
    import lightning as L
    import torch.distributed as dist

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    starts: list[float] = []
    info: dict[str, Any] = {}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return TransformersModel({"init_from_hf_path": str(ckpt)})

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx != 1:
                return super().training_step(batch, batch_idx)
            saved = SavedInside(self.model)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = super().training_step(batch, batch_idx)
            info["activation_bytes"] = saved.close()
            return loss

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
            starts.append(time.perf_counter())

        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            info["bytes"], info["tp_layer_bytes"] = _param_bytes(pl_module.model)

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy({"sharding_size": "auto", **SETTINGS[setting]}),
        callbacks=[Timer()],
    )
    trainer.fit(
        Module(lr=1e-3, log_grad_norm=False), train_dataloaders=torch.utils.data.DataLoader(Tokens(), batch_size=1)
    )
    steps = torch.tensor([b - a for a, b in zip(starts[WARMUP:], starts[WARMUP + 1 :])])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"steps": steps.tolist(), **info})
    slowest = [max(r["steps"][i] for r in gathered) for i in range(len(steps))]
    return {
        "setting": setting,
        "samplers": DEVICES // SETTINGS[setting].get("tensor_parallel_size", 1),
        "bytes_per_rank": max(r["bytes"] for r in gathered),
        "tp_layer_bytes_per_rank": max(r["tp_layer_bytes"] for r in gathered),
        "tp_layer_activation_bytes": max(r["activation_bytes"] for r in gathered),
        "steps_s": slowest,
    }


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    pooled = [t for r in rounds for t in r["steps_s"]]
    q1, median, q3 = statistics.quantiles(pooled, n=4)
    first = rounds[0]
    return {
        **{k: v for k, v in first.items() if k != "steps_s"},
        "step_s": median,
        "step_q1_s": q1,
        "step_q3_s": q3,
        "tokens_per_s": first["samplers"] * SEQ / median,
        "round_medians_s": [statistics.median(r["steps_s"]) for r in rounds],
        "steps_measured": len(pooled),
    }


def main() -> None:
    import transformers

    torch.set_num_threads(1)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "parallel_layout_bench.json"
    ckpt = Path(tempfile.gettempdir()) / "lmm_layout_bench_qwen3"
    if not (ckpt / "config.json").exists():  # written before Lightning starts the other ranks
        config = transformers.Qwen3Config(**CONFIG, attn_implementation="sdpa")
        config.architectures = ["Qwen3ForCausalLM"]
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(config).save_pretrained(ckpt)
    runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in SETTINGS}
    for _ in range(ROUNDS):
        for setting in SETTINGS:
            runs[setting].append(run(setting, ckpt))
    results = [_summary(runs[setting]) for setting in SETTINGS]
    import torch.distributed as dist

    if dist.get_rank() == 0:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG))
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        inside = sum(
            p.numel() * p.element_size()
            for n, p in model.named_parameters()
            if any(f".{layer}." in f".{n}" for layer in TP_LAYERS)
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"rounds": ROUNDS, "steps": STEPS, "warmup": WARMUP, "seq": SEQ, "model_bytes": whole}
        payload.update(tp_layer_model_bytes=inside, results=results)
        out.write_text(json.dumps(payload, indent=1))
        base = results[0]
        print(
            f"{ROUNDS} rounds of {STEPS} steps, median of steps {WARMUP}..; "
            f"model {whole:,} B ({inside:,} B in TP layers)"
        )
        print(
            "| setting | parameter bytes per rank (of the model) | of the TP layers (of theirs) | TP-layer activation "
            "bytes per rank | vs FSDP2 | step (s), median [quartiles] | vs FSDP2 | tokens/s | vs FSDP2 |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            print(
                f"| {r['setting']} | {r['bytes_per_rank']:,} ({r['bytes_per_rank'] / whole:.3f}) | "
                f"{r['tp_layer_bytes_per_rank']:,} ({r['tp_layer_bytes_per_rank'] / inside:.3f}) | "
                f"{r['tp_layer_activation_bytes']:,} | "
                f"{r['tp_layer_activation_bytes'] / base['tp_layer_activation_bytes']:.3f} | "
                f"{r['step_s']:.3f} [{r['step_q1_s']:.3f}, {r['step_q3_s']:.3f}] | "
                f"{r['step_s'] / base['step_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} |"
            )
    from tests.helpers.scenario_exit import exit_cleanly

    exit_cleanly()


if __name__ == "__main__":
    main()
