"""The strategy's side of the parity suite (see ``tests/helpers/parity.py``).

    python tests/scenarios/parity_scenarios.py GROUP OUTDIR --arg ckptdir=CKPTDIR     (tests/helpers/scenario_kit.py)

``GROUP`` is ``train`` (every case of ``TRAIN_CASES``, one after the other, on 2 ranks), ``resume`` (each case
of ``RESUME_CASES``: train, save a checkpoint, resume from it in a new Trainer, on 2 ranks) or ``resume_one``
(the ``qwen3-resume`` checkpoint written by ``resume`` resumed by a 1-process Trainer). ``CKPTDIR`` holds the
tiny Hugging Face checkpoints. Each rank writes ``OUTDIR/CASE.rank{R}.json`` (per micro-batch: its loss, the
indices of its samples and the optimizer step it belongs to); rank 0 writes the gathered final weights to
``OUTDIR/CASE.pt`` (and the initial ones to ``OUTDIR/CASE.init.pt``). A case that raises records the error
and the next case runs. Nothing is mocked.
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
from tests.helpers.parity import (  # noqa: E402
    CASES,
    LR,
    PER_RANK_BATCH,
    RESUME_CASES,
    TORCH_LAYERS,
    TP_CASES,
    TP_RESUME,
    TRAIN_CASES,
    Case,
    IndexedData,
    TorchLayersLM,
)
from tests.helpers.scenario_kit import scenario  # noqa: E402
from tests.scenarios.hf_scenarios import model_inputs  # noqa: E402


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights (a collective: every rank calls it, in the same order)."""
    return {name: _full(p) for name, p in model.named_parameters()}


def _fit(
    case: Case,
    ckptdir: Path,
    outdir: Path,
    max_steps: int,
    devices: int = 2,
    ckpt_path: str | None = None,
    batch_size: int | None = None,
) -> tuple[dict[str, Any], Any]:
    import lightning as L

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    record: dict[str, Any] = {"losses": [], "indices": [], "steps": []}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            if case.family == TORCH_LAYERS:
                return TorchLayersLM()
            return TransformersModel({"init_from_hf_path": str(ckptdir / case.family), "freeze": list(case.freeze)})

        def get_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            batch = dict(batch)
            record["indices"].append(batch.pop("index").tolist())
            return model_inputs(batch)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            record["losses"].append(float(loss.detach()))
            record["steps"].append(self.trainer.global_step)  # optimizer steps taken before this micro-batch
            return loss

    class RecordNorm(L.Callback):
        """The gradient norm each optimizer step clips with (``MMFSDP2Precision.grad_norm``, before clipping)."""

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            record.setdefault("norms", []).append(float(trainer.precision_plugin.grad_norm(optimizer)))

    class SaveInitial(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            initial = _gathered(pl_module.model)
            if trainer.global_rank == 0 and ckpt_path is None:
                torch.save(initial, outdir / f"{case.name}.init.pt")

    torch.manual_seed(0)
    module = Module(lr=LR, log_grad_norm=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        accumulate_grad_batches=case.accumulate,
        gradient_clip_val=case.clip,
        precision=case.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=outdir,
        strategy=MMFSDP2Strategy({"sharding_size": "auto", **case.fsdp2}),
        callbacks=[*([SaveInitial()] if case.family == TORCH_LAYERS else []), *([RecordNorm()] if case.clip else [])],
    )
    per_rank = batch_size if batch_size is not None else PER_RANK_BATCH * 2 // devices
    loader = torch.utils.data.DataLoader(IndexedData(case.family), batch_size=per_rank)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return record, (trainer, module)


def _finish(case: Case, outdir: Path, parts: list[dict[str, Any]], trainer: Any, module: Any) -> None:
    final = _gathered(module.model)
    rank = trainer.global_rank
    if rank == 0:
        torch.save(final, outdir / f"{case.name}.pt")
    _dump(case, outdir, rank, {"parts": parts, "error": None})


def _dump(case: Case, outdir: Path, rank: int, data: dict[str, Any]) -> None:
    (outdir / f"{case.name}.rank{rank}.json").write_text(json.dumps(data))


def _guarded(case: Case, outdir: Path, run: Any) -> None:
    try:
        run()
    except Exception:  # recorded for the test of this case; the other cases still run
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        _dump(case, outdir, rank, {"parts": [], "error": traceback.format_exc()[-4000:]})


@scenario
def train(outdir: Path, ckptdir: str) -> None:
    ckptdir = Path(ckptdir)
    for case in TRAIN_CASES:

        def run(case: Case = case) -> None:
            record, (trainer, module) = _fit(case, ckptdir, outdir, case.steps)
            _finish(case, outdir, [record], trainer, module)

        _guarded(case, outdir, run)


@scenario
def resume(outdir: Path, ckptdir: str) -> None:
    ckptdir = Path(ckptdir)
    for case in RESUME_CASES:

        def run(case: Case = case) -> None:
            assert case.resume_at is not None
            first, (trainer, _) = _fit(case, ckptdir, outdir, case.resume_at)
            trainer.save_checkpoint(outdir / f"{case.name}.ckpt")
            second, (trainer, module) = _fit(
                case, ckptdir, outdir, case.steps, ckpt_path=str(outdir / f"{case.name}.ckpt")
            )
            _finish(case, outdir, [first, second], trainer, module)

        _guarded(case, outdir, run)


def _attention_layout(module: Any) -> dict[str, list[Any]]:
    """How the first layer's q_proj and o_proj weights are laid out: mesh dimension names, placements, local shape."""
    attn = module.model.model.layers[0].self_attn
    return {
        name: [list(p.device_mesh.mesh_dim_names), [str(x) for x in p.placements], list(p.to_local().shape)]
        for name, p in (("q_proj", attn.q_proj.weight), ("o_proj", attn.o_proj.weight))
    }


@scenario
def tensor_parallel(outdir: Path, ckptdir: str) -> None:
    """``TP_CASES`` on 4 ranks (TP 2 x FSDP 2); each rank also records how its q_proj and o_proj weights are laid
    out (mesh dimension names, placements, local shape)."""
    ckptdir = Path(ckptdir)
    for case in TP_CASES:

        def run(case: Case = case) -> None:
            record, (trainer, module) = _fit(case, ckptdir, outdir, case.steps, devices=4)
            record["layout"] = _attention_layout(module)
            _finish(case, outdir, [record], trainer, module)

        _guarded(case, outdir, run)

    def resume_across_layouts(case: Case = TP_RESUME) -> None:
        # A global batch of 4 in both layouts: 2 per data-parallel rank at TP 2 (2 groups), 1 at TP 1 (4 ranks).
        assert case.resume_at is not None
        first, (trainer, module) = _fit(case, ckptdir, outdir, case.resume_at, devices=4, batch_size=2)
        first["layout"] = _attention_layout(module)
        trainer.save_checkpoint(outdir / f"{case.name}.ckpt")
        tp1 = Case(case.name, case.family, {}, clip=case.clip, steps=case.steps)
        ckpt = str(outdir / f"{case.name}.ckpt")
        second, (trainer, module) = _fit(tp1, ckptdir, outdir, case.steps, devices=4, ckpt_path=ckpt, batch_size=1)
        second["layout"] = _attention_layout(module)
        _finish(case, outdir, [first, second], trainer, module)

    _guarded(TP_RESUME, outdir, resume_across_layouts)


@scenario
def resume_one(outdir: Path, ckptdir: str) -> None:
    """The 2-rank ``qwen3-resume`` checkpoint (step 3) resumed by one process (the global batch unchanged)."""
    ckptdir = Path(ckptdir)
    case = CASES["qwen3-resume"]
    one = Case(f"{case.name}-one-rank", case.family, case.fsdp2, case.freeze, case.steps, resume_at=case.resume_at)

    def run() -> None:
        second, (trainer, module) = _fit(
            one, ckptdir, outdir, case.steps, devices=1, ckpt_path=str(outdir / f"{case.name}.ckpt")
        )
        _finish(one, outdir, [second], trainer, module)

    _guarded(one, outdir, run)


if __name__ == "__main__":
    scenario_kit.main()
