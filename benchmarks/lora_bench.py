"""LoRA vs full fine-tuning of the same Hugging Face model: per-rank bytes and step time (2 CPU ranks).

    python benchmarks/lora_bench.py [--rounds 4] [--steps 12]   # -> results/lora.json

The model is a Qwen3 built locally from a config (``--hidden``, ``--layers``; random weights saved with
``save_pretrained``, no network), trained with ``MMFSDP2Strategy`` (``sharding_size: auto``) and
``TransformersModel``: once with every weight trainable, once with LoRA (rank 8, alpha 16) on the attention and
MLP projections of every decoder layer.

* Bytes (exact, independent of the machine's load): parameters, gradients and AdamW state held by each rank,
  measured after the first step (local shards; AdamW's scalar ``step`` counters left out), next to what
  ``lightning_mm.core.memory.per_rank_memory`` (the figure ``lightning-mm plan`` prints) predicts.
* Step time: the two runs alternate within the same two processes, ``--rounds`` times, order rotating; the
  median step after 3 warm-up steps, the slower rank. Wall time on a shared machine: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

WARMUP = 3
LORA = {"rank": 8, "alpha": 16, "target_modules": ["model.layers.{*}.self_attn", "model.layers.{*}.mlp"]}


def _hf_config(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model_type="qwen3",
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _run(kind: str, hf_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.core.memory import per_rank_memory
    from lightning_mm.modules import TransformersModel

    config = {"init_from_hf_path": hf_dir, **({"lora": LORA} if kind == "lora" else {})}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return TransformersModel(config)

        def get_batch(self, batch: Any) -> dict[str, torch.Tensor]:
            ids = batch[0]
            return {"input_ids": ids, "labels": ids}

    found: dict[str, Any] = {}

    class Bytes(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            if i != 0:
                return
            model = pl_module.model
            optimizer = trainer.optimizers[0]
            found["params"] = sum(_local_bytes(p) for p in model.parameters())
            found["grads"] = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
            found["optimizer"] = sum(
                _local_bytes(v)
                for s in optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.ndim > 0
            )
            found["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            found["planned"] = per_rank_memory(model, trainer.strategy.plan).__dict__

    timer = common.StepTimer()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 4096, (2 * args.steps * args.batch, args.seq)))
    trainer = L.Trainer(
        max_steps=args.steps,
        strategy=MMFSDP2Strategy({"sharding_size": "auto"}),
        callbacks=[timer, Bytes()],
        **common.quiet_trainer_kwargs(),
    )
    trainer.fit(Module(lr=1e-4), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=args.batch))
    return {**found, "step_s": common.median(timer.step_times(WARMUP)), "losses": timer.losses}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    common.pin_threads()
    out = Path(args.out)
    hf_dir = str(out / "model")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = ["full", "lora"] if r % 2 == 0 else ["lora", "full"]
        rounds.append({kind: _run(kind, hf_dir, args) for kind in order})
        if dist.is_initialized():
            dist.barrier()
    common.write_rank_json(out, "lora", {"rounds": rounds})


def _save_model(args: argparse.Namespace, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _hf_config(args)
    torch.manual_seed(0)
    config = AutoConfig.for_model(**cfg)
    config.architectures = ["Qwen3ForCausalLM"]
    AutoModelForCausalLM.from_config(config).save_pretrained(out / "model")


def main() -> None:
    parser = common.benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = common.parse_or_work(parser, worker, out="")
    if args is None:  # a rank: worker() has run
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _save_model(args, out)
        before = common.loadavg()
        flags = [f"--{k}={getattr(args, k)}" for k in ("rounds", "steps", "hidden", "layers", "batch", "seq")]
        common.launch_ranks(Path(__file__), [*flags, "--worker", f"--out={out}"])
        ranks = common.read_rank_jsons(out, "lora")
    summary: dict[str, Any] = {
        "machine": common.machine(),
        "load_before": before,
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
    }
    for kind in ("full", "lora"):
        first = [r["rounds"][0][kind] for r in ranks]
        steps = [max(r["rounds"][i][kind]["step_s"] for r in ranks) for i in range(args.rounds)]
        summary[kind] = {
            "trainable_params": first[0]["trainable_params"],
            "bytes_per_rank_max": {k: max(f[k] for f in first) for k in ("params", "grads", "optimizer")},
            "planned": first[0]["planned"],
            "step_s_rounds": steps,
            "step_s_median": common.median(steps),
        }
    summary["lora_over_full_step"] = [
        lo / fu for lo, fu in zip(summary["lora"]["step_s_rounds"], summary["full"]["step_s_rounds"])
    ]
    summary["load_after"] = common.loadavg()
    path = common.save_result("lora", summary)
    for kind in ("full", "lora"):
        s = summary[kind]
        b = s["bytes_per_rank_max"]
        print(
            f"{kind:>4}: trainable {s['trainable_params']:,}  params {b['params']:,} B  grads {b['grads']:,} B  "
            f"optimizer {b['optimizer']:,} B  (planned {s['planned']['params']:,} / {s['planned']['grads']:,} / "
            f"{s['planned']['optimizer']:,})  step {s['step_s_median'] * 1e3:.1f} ms"
        )
    print(f"lora/full step ratio per round: {[round(x, 3) for x in summary['lora_over_full_step']]}; wrote {path}")


if __name__ == "__main__":
    main()
