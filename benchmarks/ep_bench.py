"""Expert parallelism on 4 CPU ranks: per-rank parameter bytes and step time, with EP against without.

    python benchmarks/ep_bench.py [OUT.json]
    EP_BENCH_ROUNDS=3 EP_BENCH_STEPS=34 EP_BENCH_EXPERTS=eager python benchmarks/ep_bench.py   # the defaults

A small random Qwen3-MoE (real Transformers class, fp32: 4 layers, hidden 128, 16 experts of width 256, top-2),
saved once and trained through ``TransformersModel`` with ``Trainer(accelerator="cpu", devices=4)`` (gloo), one
compute thread per rank, in four settings one after the other in the same processes: no EP (``sharding_size:
auto``), EP 2 and EP 4 (local experts FSDP-sharded over ``ep_replicate``) and EP 4 with ``reshard_local_experts:
false``. The four settings run ``EP_BENCH_ROUNDS`` times in turn (round-robin, so that a change in the machine's
load touches every setting alike), ``EP_BENCH_STEPS`` steps each. Per setting: the bytes of the parameter storage
each rank holds after sharding (the local shards, the largest rank), the plan's computed figure, and the median
step time (wall, slowest rank) over every round's steps after the first ``WARMUP``, with its quartiles.
``EP_BENCH_EXPERTS`` picks Transformers' experts kernel (``eager``, the default here; or
``grouped_mm`` / ``batched_mm``, set on the config after building). Not a test: nothing here is asserted.
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

STEPS = int(os.environ.get("EP_BENCH_STEPS", "34"))
ROUNDS = int(os.environ.get("EP_BENCH_ROUNDS", "3"))
EXPERTS_KERNEL = os.environ.get("EP_BENCH_EXPERTS", "eager")
WARMUP, DEVICES = 4, 4
CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    num_experts=16,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
EXPERTS = "model.layers.{*}.mlp.experts"
SETTINGS: dict[str, dict[str, Any]] = {
    "no EP": {},
    "EP 2": {"expert_parallel_size": 2, "moe_modules": [EXPERTS]},
    "EP 4": {"expert_parallel_size": 4, "moe_modules": [EXPERTS]},
    "EP 4, whole local experts": {"expert_parallel_size": 4, "moe_modules": [EXPERTS], "reshard_local_experts": False},
}


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4 * STEPS * DEVICES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(10, CONFIG["vocab_size"], (128,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _local_bytes(model: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def run(setting: str, ckpt: Path) -> dict[str, Any]:
    import lightning as L
    import torch.distributed as dist

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    starts: list[float] = []
    info: dict[str, Any] = {}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            model = TransformersModel({"init_from_hf_path": str(ckpt)})
            model.config._experts_implementation = EXPERTS_KERNEL
            return model

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
            starts.append(time.perf_counter())

        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            plan = trainer.strategy.plan
            info["bytes"] = _local_bytes(pl_module.model)
            if plan.experts is not None:
                info["plan_bytes"] = sum(plan.bytes_per_rank())

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
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"steps": steps.tolist(), "bytes": info["bytes"]})
    slowest = [max(r["steps"][i] for r in gathered) for i in range(len(steps))]
    return {
        "setting": setting,
        "bytes_per_rank": max(r["bytes"] for r in gathered),
        "plan_bytes_per_rank": info.get("plan_bytes"),
        "steps_s": slowest,
    }


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting over its rounds: the step times pooled, their median and quartiles, and each round's median."""
    pooled = [t for r in rounds for t in r["steps_s"]]
    q1, median, q3 = statistics.quantiles(pooled, n=4)
    return {
        "setting": rounds[0]["setting"],
        "bytes_per_rank": rounds[0]["bytes_per_rank"],
        "plan_bytes_per_rank": rounds[0]["plan_bytes_per_rank"],
        "step_s": median,
        "step_q1_s": q1,
        "step_q3_s": q3,
        "round_medians_s": [statistics.median(r["steps_s"]) for r in rounds],
        "steps_measured": len(pooled),
    }


def main() -> None:
    import transformers

    if os.environ.get("FH"):
        import faulthandler

        faulthandler.dump_traceback_later(
            int(os.environ["FH"]), exit=False, file=open(f"/tmp/fh_{os.getpid()}.txt", "w")
        )  # noqa: SIM115

    torch.set_num_threads(1)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "ep_bench.json"
    ckpt = Path(tempfile.gettempdir()) / "lmm_ep_bench_qwen3_moe"
    if not (ckpt / "config.json").exists():  # written before Lightning starts the other ranks
        config = transformers.Qwen3MoeConfig(**CONFIG)
        config.architectures = ["Qwen3MoeForCausalLM"]
        torch.manual_seed(0)
        transformers.Qwen3MoeForCausalLM(config).save_pretrained(ckpt, save_original_format=False)
    only = os.environ.get("EP_BENCH_ONLY")
    settings = [setting for setting in SETTINGS if not only or setting in only.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in settings}
    for _ in range(ROUNDS):
        for setting in settings:
            runs[setting].append(run(setting, ckpt))
    results = [_summary(runs[setting]) for setting in settings]
    import torch.distributed as dist

    if dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "experts_kernel": EXPERTS_KERNEL,
                    "rounds": ROUNDS,
                    "steps": STEPS,
                    "warmup": WARMUP,
                    "results": results,
                },
                indent=1,
            )
        )
        base = results[0]
        print(f"experts kernel {EXPERTS_KERNEL}, {ROUNDS} rounds of {STEPS} steps, median of steps {WARMUP}..")
        print(
            "| setting | parameter bytes per rank | vs no EP | step (s), median [quartiles] | vs no EP "
            "| round medians (s) |"
        )
        print("|---|---:|---:|---:|---:|---|")
        for r in results:
            rounds = ", ".join(f"{m:.3f}" for m in r["round_medians_s"])
            print(
                f"| {r['setting']} | {r['bytes_per_rank']:,} | {r['bytes_per_rank'] / base['bytes_per_rank']:.2f} | "
                f"{r['step_s']:.3f} [{r['step_q1_s']:.3f}, {r['step_q3_s']:.3f}] | "
                f"{r['step_s'] / base['step_s']:.2f} | {rounds} |"
            )
    from tests.helpers.scenario_exit import exit_cleanly

    exit_cleanly()


if __name__ == "__main__":
    main()
