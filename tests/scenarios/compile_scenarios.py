"""2-rank scenario for per-block torch.compile (tests/helpers/scenario_kit.py):
``python tests/scenarios/compile_scenarios.py compile_runs OUTDIR --arg model_dir=MODELDIR --arg moe_dir=MOEDIR``.

A tiny Qwen3 (a Transformers ``save_pretrained`` directory, ``MODELDIR``, written by the test) trained through
``TransformersModel`` by ``MMFSDP2Strategy`` (Lightning's launcher re-runs this script for rank 1; gloo, real
collectives) with its decoder layers as FSDP units compiled per block, on batches whose sequence length changes
every step: plain, with reentrant recomputation, with Ulysses context parallelism (CP 2), and with LoRA, bf16
parameters and an ignored (frozen) embedding, against the same run eager; and a tiny Qwen3-MoE (``MOEDIR``) with
expert parallelism 2 and each block's attention compiled. Each rank also trains the model of
``MODELDIR`` in one process without sharding or compile on the global batches (the reference). The backend is
``aot_eager`` (dynamo's capture and AOT autograd, eager kernels), so compiled and eager runs compute the same
numbers; tests/test_compile.py checks the inductor backend's numerics in one process. Each rank writes what it
saw to ``OUTDIR/compile.rank{R}.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy, MMLightningModule  # noqa: E402
from lightning_mm._compat import compiled_graph_count  # noqa: E402
from lightning_mm.modules import TransformersModel  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario, write_result  # noqa: E402

CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
    use_cache=False,
)
BATCH, STEPS, LR = 2, 4, 0.5
LAYERS = "model.layers.{*}"
LORA = {
    "target_modules": ["model.layers.{*}.self_attn.q_proj", "model.layers.{*}.self_attn.v_proj"],
    "rank": 4,
    "init_lora_weights": "gaussian",
}


MOE = dict(
    CONFIG,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)


def write_model(directory: Path, moe: bool = False) -> None:
    torch.manual_seed(0)
    if moe:
        transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE)).save_pretrained(directory)
    else:
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).save_pretrained(directory)


def length(step: int) -> int:
    return 8 + 4 * step  # a new sequence length every step


class Varying(torch.utils.data.Dataset):
    """Sample ``i`` belongs to step ``i // (2 * BATCH)``."""

    def __len__(self) -> int:
        return 2 * BATCH * STEPS

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, CONFIG["vocab_size"], (length(i // (2 * BATCH)),), generator=g)


class Module(MMLightningModule):
    def __init__(self, model_dir: str, lora: bool, config: dict[str, Any]) -> None:
        super().__init__(fsdp2_config=config, log_grad_norm=False, log_throughput=False)
        self.model_dir, self.lora, self.losses = model_dir, lora, []

    def model_provider(self) -> torch.nn.Module:
        return TransformersModel({"init_from_hf_path": self.model_dir, **({"lora": LORA} if self.lora else {})})

    def forward_step(self, batch: torch.Tensor) -> Any:
        return self.model(input_ids=batch, labels=batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)


def fit(
    model_dir: str,
    compiled: bool = True,
    reentrant: bool | None = None,
    cp: int = 1,
    lora: bool = False,
    extra: dict[str, Any] | None = None,
    compile_modules: str = LAYERS,
) -> dict[str, Any]:
    config: dict[str, Any] = {"sharding_size": "auto", "sub_modules_to_wrap": [LAYERS], **(extra or {})}
    if reentrant is not None:
        config.update(recompute_modules=[LAYERS], use_reentrant=reentrant)
    if compiled:
        config.update(compile_modules=[compile_modules], compile_backend="aot_eager")
    torch.compiler.reset()  # count this run's graphs only
    before = compiled_graph_count()
    module = Module(model_dir, lora, config)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=MMFSDP2Strategy(context_parallel_size=cp),
    )
    # Lightning would shuffle a training loader's samples; these samplers keep step k's samples in step k (with
    # CP 2 both ranks read the same samples: there is one data-parallel rank).
    replicas = 2 // cp
    sampler = torch.utils.data.DistributedSampler(
        Varying(), num_replicas=replicas, shuffle=False, rank=int(os.environ.get("LOCAL_RANK", 0)) % replicas
    )
    trainer.fit(module, torch.utils.data.DataLoader(Varying(), batch_size=BATCH * cp, sampler=sampler))
    return {"losses": module.losses, "graphs": compiled_graph_count() - before}


def reference(model_dir: str) -> list[float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data, losses = Varying(), []
    for step in range(STEPS):
        batch = torch.stack([data[i] for i in range(2 * BATCH * step, 2 * BATCH * (step + 1))])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


@scenario
def compile_runs(outdir: Path, model_dir: str, moe_dir: str) -> None:
    """Every run of the module docstring, one after the other, in one launch."""
    mixed = {"param_dtype": "bf16", "reduce_dtype": "fp32", "ignored_modules": ["model.embed_tokens"]}
    results: dict[str, Any] = {
        "compiled": fit(model_dir),
        "compiled_reentrant": fit(model_dir, reentrant=True),
        "compiled_cp2": fit(model_dir, cp=2),
        "lora_bf16_compiled": fit(model_dir, lora=True, extra=mixed),
        "lora_bf16_eager": fit(model_dir, compiled=False, lora=True, extra=mixed),
        "reference": reference(model_dir),
        # Expert parallelism: the experts' dispatch communicates, so the attention inside each block is compiled.
        "moe_ep2_compiled_attention": fit(
            moe_dir,
            compile_modules="model.layers.{*}.self_attn",
            extra={"expert_parallel_size": 2, "moe_modules": ["model.layers.{*}.mlp.experts"]},
        ),
        "moe_reference": reference(moe_dir),
    }
    write_result(outdir, "compile", results, int(os.environ.get("LOCAL_RANK", 0)))


if __name__ == "__main__":
    scenario_kit.main()
