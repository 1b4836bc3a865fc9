"""2-rank scenario for per-block torch.compile: ``python tests/compile_scenarios.py OUTDIR``.

A tiny Qwen3 (Transformers) trained by ``MMFSDP2Strategy`` (Lightning's launcher re-runs this script for rank 1;
gloo, real collectives) with its decoder layers as FSDP units, compiled per block, with and without reentrant
recomputation, on batches whose sequence length changes every step. Each rank also trains the same
model in one process without any sharding or compile on the global batches (the reference). The backend is
``aot_eager`` (dynamo's capture and AOT autograd, eager kernels), so compiled and eager runs compute the same
numbers; tests/test_compile.py checks the inductor backend's numerics in one process. Each rank writes what it
saw to ``OUTDIR/compile.rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy, MMLightningModule  # noqa: E402
from lightning_mm._compat import compiled_graph_count  # noqa: E402

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, use_cache=False)
BATCH, STEPS = 2, 4


def lengths(step: int) -> int:
    return 8 + 4 * step  # a new sequence length every step


class Varying(torch.utils.data.Dataset):
    """Sample ``i`` belongs to step ``i // (2 * BATCH)`` (rank r gets i = r, r + 2, ...)."""

    def __len__(self) -> int:
        return 2 * BATCH * STEPS

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, CONFIG["vocab_size"], (lengths(i // (2 * BATCH)),), generator=g)


def qwen3() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).float()


class Module(MMLightningModule):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(fsdp2_config=config, log_grad_norm=False, log_throughput=False)
        self.losses: list[float] = []

    def model_provider(self) -> torch.nn.Module:
        return qwen3()

    def forward_step(self, batch: torch.Tensor) -> Any:
        return self.model(input_ids=batch, labels=batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(compiled: bool, use_reentrant: bool | None) -> dict[str, Any]:
    """Train ``STEPS`` steps; the losses each rank saw and the graphs torch.compile made (non-reentrant
    recomputation is checked with the inductor backend in tests/test_compile.py)."""
    config: dict[str, Any] = {"sharding_size": "auto", "sub_modules_to_wrap": ["model.layers.{*}"]}
    if use_reentrant is not None:
        config.update(recompute_modules=["model.layers.{*}"], use_reentrant=use_reentrant)
    if compiled:
        config.update(compile_modules=["model.layers.{*}"], compile_backend="aot_eager")
    torch.compiler.reset()  # count this run's graphs only
    before = compiled_graph_count()
    module = Module(config)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=MMFSDP2Strategy(empty_init=False))
    # Lightning would shuffle a training loader's samples; this sampler keeps step k's samples in step k.
    sampler = torch.utils.data.DistributedSampler(Varying(), num_replicas=2, rank=int(os.environ.get("LOCAL_RANK", 0)),
                                                  shuffle=False)
    trainer.fit(module, torch.utils.data.DataLoader(Varying(), batch_size=BATCH, sampler=sampler))
    return {"losses": module.losses, "graphs": compiled_graph_count() - before}


def reference() -> list[float]:
    model = qwen3()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data, losses = Varying(), []
    for step in range(STEPS):
        batch = torch.stack([data[i] for i in range(2 * BATCH * step, 2 * BATCH * (step + 1))])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, reentrant in (("compiled", None), ("compiled_reentrant", True)):
        results[name] = fit(True, reentrant)
    results["reference"] = reference()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    Path(out, f"compile.rank{rank}.json").write_text(json.dumps(results))
    from tests.scenario_exit import exit_cleanly

    exit_cleanly()
