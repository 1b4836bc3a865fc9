"""The strategy's side of the chunked-loss parity checks (``tests/test_chunk_loss.py``).

    python tests/scenarios/chunkloss_scenarios.py all_cases OUTDIR     (tests/helpers/scenario_kit.py)

Every case of :data:`CASES`, one after the other, trains a tiny Hugging Face checkpoint of ``OUTDIR/ckpts`` (written
by the pytest side before the launch, so the ranks never race to write them) with
``MMFSDP2Strategy`` on 2 ranks (gloo, CPU) and ``TransformersModel(enable_chunk_loss=True)``; each rank writes
``OUTDIR/CASE.rank{R}.json`` (per micro-batch: its loss, its sample indices, the optimizer step, and whether the
model's output had no logits, i.e. the chunked loss ran) and rank 0 the gathered final weights to
``OUTDIR/CASE.pt``. The pytest side compares them with ``tests/helpers/parity.py``'s one-process plain Transformers
reference (the model's own, unchunked loss). A case that raises records its error; the next case runs.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.parity import LR, PER_RANK_BATCH, Case, IndexedData  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402
from tests.scenarios.hf_scenarios import model_inputs  # noqa: E402

CHUNK = 5  # tokens per chunk: 32 tokens per rank and micro-batch make 6 full chunks and a remainder of 2
CASES = [
    Case("qwen3-chunked", "qwen3", steps=3),  # the output layer is an FSDP unit of its own (the default plan)
    Case("llama_tied-chunked", "llama_tied", steps=3),  # tied: lm_head grouped with embed_tokens in one unit
    Case("qwen2_5_vl-chunked", "qwen2_5_vl", steps=3),  # a VLM: model (vision + decoder) + lm_head
    # The output layer in the root unit, and two micro-batches per step.
    Case("qwen3-chunked-head-in-root", "qwen3", {"sub_modules_to_wrap": ["model.layers.{*}"]}, steps=2, accumulate=2),
    Case("qwen3-chunked-lora-head", "qwen3", steps=3),  # LoRA on lm_head (and q_proj), the head a unit
]
LORA = {
    "rank": 4,
    "alpha": 8,
    "init_lora_weights": "gaussian",
    "target_modules": ["lm_head", "model.layers.{*}.self_attn.q_proj"],
}
"""The adapters of the ``-lora-`` case (gaussian B: the head's adapters change the loss from the first step)."""


def model_config(case: Case, ckptdir: Path, chunked: bool = True) -> dict[str, Any]:
    """The TransformersModel config of ``case`` (the pytest side builds its LoRA reference with ``chunked=False``)."""
    config: dict[str, Any] = {"init_from_hf_path": str(ckptdir / case.family)}
    if chunked:
        config.update(enable_chunk_loss=True, chunk_loss_size=CHUNK)
    if "-lora-" in case.name:
        config["lora"] = LORA
    return config


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _fit(case: Case, ckptdir: Path, outdir: Path) -> None:
    import lightning as L

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    record: dict[str, Any] = {"losses": [], "indices": [], "steps": [], "no_logits": []}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return TransformersModel(model_config(case, ckptdir))

        def get_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            batch = dict(batch)
            record["indices"].append(batch.pop("index").tolist())
            return model_inputs(batch)

        def forward_step(self, batch: Any) -> Any:
            output = super().forward_step(batch)
            record["no_logits"].append(output.logits is None)
            return output

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            record["losses"].append(float(loss.detach()))
            record["steps"].append(self.trainer.global_step)
            return loss

    torch.manual_seed(0)
    module = Module(lr=LR, log_grad_norm=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=case.steps,
        accumulate_grad_batches=case.accumulate,
        precision=case.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=outdir,
        strategy=MMFSDP2Strategy({"sharding_size": "auto", **case.fsdp2}),
    )
    loader = torch.utils.data.DataLoader(IndexedData(case.family), batch_size=PER_RANK_BATCH)
    trainer.fit(module, train_dataloaders=loader)
    final = {name: _full(p) for name, p in module.model.named_parameters()}  # a collective: every rank
    if trainer.global_rank == 0:
        torch.save(final, outdir / f"{case.name}.pt")
    _dump(case, outdir, trainer.global_rank, {"parts": [record], "error": None})


def _dump(case: Case, outdir: Path, rank: int, data: dict[str, Any]) -> None:
    (outdir / f"{case.name}.rank{rank}.json").write_text(json.dumps(data))


@scenario
def all_cases(outdir: Path) -> None:
    ckptdir = outdir / "ckpts"
    for case in CASES:
        try:
            _fit(case, ckptdir, outdir)
        except Exception:  # recorded for the test of this case; the other cases still run
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            _dump(case, outdir, rank, {"parts": [], "error": traceback.format_exc()[-4000:]})


if __name__ == "__main__":
    scenario_kit.main()
