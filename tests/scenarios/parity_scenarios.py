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
import os
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
    callbacks: list[Any] | None = None,
) -> tuple[dict[str, Any], Any]:
    import lightning as L

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    record: dict[str, Any] = {"losses": [], "indices": [], "steps": []}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            if case.family == TORCH_LAYERS:
                return TorchLayersLM()
            lora = {"lora": case.lora} if case.lora is not None else {}
            return TransformersModel(
                {"init_from_hf_path": str(ckptdir / case.family), "freeze": list(case.freeze), **lora, **case.model}
            )

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
        callbacks=[
            *([SaveInitial()] if case.family == TORCH_LAYERS else []),
            *([RecordNorm()] if case.clip else []),
            *(callbacks or []),
        ],
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
    """How the first decoder layer's q_proj and o_proj weights are laid out (mesh dimension names, placements,
    local shape), and the first vision block's qkv weight where the model has a vision tower."""
    modules = dict(module.model.named_modules())
    attn = next(m for name, m in modules.items() if name.endswith("layers.0.self_attn"))
    weights = {"q_proj": attn.q_proj.weight, "o_proj": attn.o_proj.weight}
    block = next((m for name, m in modules.items() if name.endswith("visual.blocks.0.attn")), None)
    if block is not None:
        weights["vision_qkv"] = block.qkv.weight
    experts = next((m for name, m in modules.items() if name.endswith("layers.0.mlp.experts")), None)
    if experts is not None:
        weights["experts"] = next(experts.parameters())
    head = next((m for name, m in modules.items() if name.endswith("lm_head")), None)
    if head is not None and hasattr(head.weight, "device_mesh"):
        weights["lm_head"] = head.weight
    return {
        name: [list(p.device_mesh.mesh_dim_names), [str(x) for x in p.placements], list(p.to_local().shape)]
        for name, p in weights.items()
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (SequenceParallel hands its norm a DTensor, whose shape is the global one)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _sequence_seen(lengths: list[int]) -> Any:
    """A callback that records the sequence lengths the first decoder layer's ``input_layernorm`` sees in
    ``lengths`` (halved by sequence parallelism)."""
    import lightning as L

    class SequenceSeen(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            norm = next(m for n, m in pl_module.model.named_modules() if n.endswith("layers.0.input_layernorm"))
            norm.register_forward_pre_hook(lambda _, args: lengths.append(int(_local(args[0]).shape[1])))

    return SequenceSeen()


def _lightning_tp(outdir: Path, name: str, tp: int) -> None:
    """Lightning's ``test_tensor_parallel`` (TP over every rank) and ``test_fsdp2_tensor_parallel`` (TP 2 x FSDP2 2)
    of ``tests_pytorch/strategies/test_model_parallel_integration.py``, adapted: the same feed-forward model split by
    a YAML ``tp_plan`` instead of a hand-written ``configure_model``, 4 ranks. Each rank records what it observed."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.demos.boring_classes import RandomDataset
    from torch.distributed.tensor import DTensor

    from lightning_mm import MMFSDP2Strategy, MMLightningModule

    class FeedForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Linear(32, 64)
            self.w2 = torch.nn.Linear(32, 64)
            self.w3 = torch.nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w3(torch.nn.functional.silu(self.w1(x)) * self.w2(x))

    seen: dict[str, Any] = {}

    class Model(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return FeedForward()

        def on_train_start(self) -> None:
            params = [p for g in self.optimizers().optimizer.param_groups for p in g["params"]]
            w1 = self.model.w1.weight
            seen["params_dtensor"] = all(isinstance(p, DTensor) for p in self.model.parameters())
            seen["optimizer_dtensor"] = all(isinstance(p, DTensor) for p in params)
            seen["not_meta"] = all(p.device.type != "meta" for p in [*self.model.parameters(), *params])
            seen["w1_mesh"] = [list(w1.device_mesh.mesh_dim_names), list(w1.device_mesh.shape)]
            seen["w3_placements"] = [str(x) for x in self.model.w3.weight.placements]
            loader = self.trainer.train_dataloader
            seen["batches"] = len(loader)
            seen["sampler"] = [type(loader.sampler).__name__, loader.sampler.num_replicas]

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, batch.tolist())
            seen.setdefault("gathered", []).append(gathered)
            return self.model(batch).sum()

    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=MMFSDP2Strategy(
            {
                "sharding_size": "auto",
                "tensor_parallel_size": tp,
                "tp_plan": {"w1": "colwise", "w2": "colwise", "w3": "rowwise"},
            }
        ),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    L.seed_everything(0)
    trainer.fit(Model(lr=1e-3), train_dataloaders=torch.utils.data.DataLoader(RandomDataset(32, 8), batch_size=2))
    _dump(Case(name, TORCH_LAYERS), outdir, trainer.global_rank, {"parts": [seen], "error": None})


def _save_every_expert(case: Case, outdir: Path, module: Any, ep: int) -> None:
    """Rewrite ``OUTDIR/CASE.pt`` with every expert: the ranks of the first EP group (ranks ``0..ep-1``, which hold
    consecutive shares of the experts) send rank 0 their local experts (a collective: every rank calls it)."""
    import torch.distributed as dist

    final = _gathered(module.model)
    local = {name: t for name, t in final.items() if ".mlp.experts." in name}
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, local)
    if dist.get_rank() == 0:
        final.update({name: torch.cat([shares[r][name] for r in range(ep)]) for name in local})
        torch.save(final, outdir / f"{case.name}.pt")


def _vocab_parallel_ce(outdir: Path, name: str) -> None:
    """``linear_cross_entropy`` vocabulary-parallel on the 2 ranks of each TP group ({0, 1}, {2, 3}): each holds
    half of a 10-row vocabulary (weight and bias), the same hidden states and targets (``-100`` among them, chunks
    of 5 of 21 tokens, the last uneven); recorded: the relative errors of the loss and of the gradients of the
    hidden states and of this rank's weight and bias rows against ``torch.nn.functional.cross_entropy`` of the
    whole logits (fp32)."""
    import torch.distributed as dist

    from lightning_mm.core.chunked_loss import linear_cross_entropy

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    index = rank % 2
    torch.manual_seed(rank // 2)  # the same data within a TP group
    vocab, k = 10, 8
    hidden = torch.randn(3, 7, k)
    weight, bias = torch.randn(vocab, k), torch.randn(vocab)
    targets = torch.randint(0, vocab, (3, 7))
    targets[0, :3] = -100
    targets[2, 6] = -100
    ref = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    expected = torch.nn.functional.cross_entropy(
        (ref[0] @ ref[1].t() + ref[2]).reshape(-1, vocab), targets.reshape(-1), ignore_index=-100
    )
    expected.backward()
    rows = slice(index * vocab // 2, (index + 1) * vocab // 2)
    mine = [hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_(), bias[rows].clone().requires_grad_()]
    loss = linear_cross_entropy(
        mine[0], mine[1], targets, bias=mine[2], chunk_size=5, group=groups[rank // 2], vocab_start=rows.start
    )
    loss.backward()

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    assert ref[0].grad is not None and ref[1].grad is not None and ref[2].grad is not None
    errors = {
        "loss": error(loss.detach(), expected.detach()),
        "hidden": error(mine[0].grad, ref[0].grad),
        "weight": error(mine[1].grad, ref[1].grad[rows]),
        "bias": error(mine[2].grad, ref[2].grad[rows]),
    }
    owned = ((targets >= rows.start) & (targets < rows.stop)).sum().item()
    _dump(Case(name, TORCH_LAYERS), outdir, rank, {"parts": [{"errors": errors, "owned": owned}], "error": None})


@scenario
def tensor_parallel(outdir: Path, ckptdir: str) -> None:
    """``TP_CASES`` on 4 ranks (TP 2 x FSDP 2); each rank also records how its q_proj and o_proj weights are laid
    out (mesh dimension names, placements, local shape)."""
    from lightning_mm.core.compile import is_compiled
    from tests.helpers.moe_models import register_moe_families

    ckptdir = Path(ckptdir)
    register_moe_families()
    only = os.environ.get("TP_ONLY")  # a comma-separated subset of the cases, for debugging
    for case in TP_CASES:
        if only and case.name not in only.split(","):
            continue

        def run(case: Case = case) -> None:
            lengths: list[int] = []
            record, (trainer, module) = _fit(
                case, ckptdir, outdir, case.steps, devices=4, callbacks=[_sequence_seen(lengths)]
            )
            record["layout"] = _attention_layout(module)
            record["norm_sequence"] = sorted(set(lengths))
            record["compiled"] = [p for p, m in module.named_modules() if is_compiled(getattr(m, "forward", None))]
            _finish(case, outdir, [record], trainer, module)
            if case.fsdp2.get("expert_parallel_size", 1) > 1:
                _save_every_expert(case, outdir, module, case.fsdp2["expert_parallel_size"])

        _guarded(case, outdir, run)
    import torch.distributed as dist

    name = "vocab-parallel-ce"  # after a case: the Trainer has started the 4 ranks
    if dist.is_initialized() and (not only or name in only.split(",")):
        _guarded(Case(name, TORCH_LAYERS), outdir, lambda: _vocab_parallel_ce(outdir, name))

    def resume_across_layouts(case: Case = TP_RESUME) -> None:
        # A global batch of 4 in every layout: 2 per data-parallel rank at TP 2 (2 groups), 1 at TP 1 (4 ranks), 4
        # at TP 4 (one group). The TP 2 checkpoint is resumed twice: at TP 1 x FSDP2 4, then at TP 4 x FSDP2 1.
        assert case.resume_at is not None
        first, (trainer, module) = _fit(case, ckptdir, outdir, case.resume_at, devices=4, batch_size=2)
        first["layout"] = _attention_layout(module)
        trainer.save_checkpoint(outdir / f"{case.name}.ckpt")
        ckpt = str(outdir / f"{case.name}.ckpt")
        parts = [first]
        for tp, batch in ((1, 1), (4, 4)):
            again = Case(case.name, case.family, {"tensor_parallel_size": tp}, clip=case.clip, steps=case.steps)
            part, (trainer, module) = _fit(
                again, ckptdir, outdir, case.steps, devices=4, ckpt_path=ckpt, batch_size=batch
            )
            part["layout"] = _attention_layout(module)
            parts.append(part)
            final = _gathered(module.model)
            if trainer.global_rank == 0:
                torch.save(final, outdir / f"{case.name}.tp{tp}.pt")
        _finish(case, outdir, parts, trainer, module)

    if not only or TP_RESUME.name in only.split(","):
        _guarded(TP_RESUME, outdir, resume_across_layouts)
    for tp in (2, 4):  # Lightning's ModelParallelStrategy TP tests, adapted (tests/test_tensor_parallel.py)
        name = f"lightning-tp{tp}"
        if not only or name in only.split(","):
            _guarded(Case(name, TORCH_LAYERS), outdir, lambda tp=tp, name=name: _lightning_tp(outdir, name, tp))


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
