"""Optimiser-state checkpoint scenarios: ``python tests/scenarios/ckptstate_scenarios.py SCENARIO WORKDIR``
(tests/helpers/scenario_kit.py).

A tiny LLaVA (a real Transformers class, random weights): its default ``vision_feature_layer=-2`` leaves the vision
tower's last layer without gradients, so AdamW has no state for it. Real Lightning jobs on CPU (gloo) on 2 or 1
ranks; plain Lightning DDP is the reference. Each scenario writes ``WORKDIR/SCENARIO.rank{R}.json`` and full
states as ``.pt`` files (name-keyed); tests/test_checkpoint_state.py asserts on them. Nothing is mocked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402
from tests.scenarios.hf_scenarios import FamilyData, model_inputs, tiny_hf_model  # noqa: E402

STEPS = 6  # two epochs of 3 batches per rank on 2 ranks (12 samples, batch 2)
SAVE_AT = 3  # the epoch boundary: every strategy restarts the data of the next epoch identically


class Llava(L.LightningModule):
    """A plain LightningModule (as a DDP user writes it) around a tiny LLaVA; AdamW with weight decay."""

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = tiny_hf_model("llava", seed=3).train()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**model_inputs(batch)).loss

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.model(**model_inputs(batch)).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def data(batch_size: int = 2) -> DataLoader:
    return DataLoader(FamilyData("llava", n=12), batch_size=batch_size, shuffle=False)


def full_state(module: L.LightningModule, trainer: L.Trainer) -> dict[str, Any]:
    """Gathered, name-keyed model and optimiser state (collective; meaningful on rank 0)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(module, options=options)
    optims = [get_optimizer_state_dict(module, o, options=options) for o in trainer.optimizers]
    return {"model": model, "optimizers": optims, "global_step": trainer.global_step}


def _local(value: Any) -> Any:
    """A state with DTensors as their local shards (what this rank holds), for torch.save."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def dump_optimizer_states(trainer: L.Trainer, work: Path, name: str, when: str) -> None:
    """What ``trainer.strategy.optimizer_state`` returns, as Lightning's own round-trip tests take it: under
    mm_fsdp2 in both layouts (``torch``: gathered, index-keyed, on rank 0; ``torch_dcp``: this rank's shards,
    name-keyed), under another strategy its own. ``WORK/NAME.optstate.WHEN.VIEW.rankR.pt``."""
    strategy, rank = trainer.strategy, trainer.global_rank
    if isinstance(strategy, MMFSDP2Strategy):
        kept = strategy.checkpoint_format
        for fmt in ("torch", "torch_dcp"):
            strategy.checkpoint_format = fmt
            states = [_local(strategy.optimizer_state(o)) for o in trainer.optimizers]
            torch.save(states, work / f"{name}.optstate.{when}.{fmt}.rank{rank}.pt")
        strategy.checkpoint_format = kept
    else:
        states = [_local(strategy.optimizer_state(o)) for o in trainer.optimizers]
        torch.save(states, work / f"{name}.optstate.{when}.own.rank{rank}.pt")


class Record(L.Callback):
    """Per-step losses; the full state right after the restore (train start) and at the end."""

    def __init__(self, work: Path, name: str) -> None:
        self.work, self.name, self.losses = work, name, []
        self.batches: list[dict[str, torch.Tensor]] = []  # this rank's batches after the checkpoint step

    def _dump(self, trainer: L.Trainer, module: L.LightningModule, what: str) -> None:
        state = full_state(module, trainer)
        if trainer.global_rank == 0:
            torch.save(state, self.work / f"{self.name}.{what}.pt")

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.global_step > 0:  # resumed (before any step, taking the state would create it for every param)
            self._dump(trainer, pl_module, "start")
            dump_optimizer_states(trainer, self.work, self.name, "restored")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach()))
        if trainer.global_step > SAVE_AT:
            self.batches.append({k: v.clone() for k, v in batch.items()})

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._dump(trainer, pl_module, "end")
        torch.save(self.batches, self.work / f"{self.name}.batches.rank{trainer.global_rank}.pt")


class SaveAt(L.Callback):
    """At step ``step``: the full state to ``WORK/NAME.at{step}.pt`` and a checkpoint per format in ``paths``.

    ``paths`` maps a ``checkpoint_format`` of MMFSDP2Strategy (or anything, for another strategy) to a path.
    """

    def __init__(self, work: Path, name: str, step: int, paths: dict[str, Path]) -> None:
        self.work, self.name, self.step, self.paths = work, name, step, paths

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step != self.step:
            return
        state = full_state(pl_module, trainer)
        if trainer.global_rank == 0:
            torch.save(state, self.work / f"{self.name}.at{self.step}.pt")
        dump_optimizer_states(trainer, self.work, self.name, "saved")
        strategy = trainer.strategy
        for fmt, path in self.paths.items():
            if isinstance(strategy, MMFSDP2Strategy):
                strategy.checkpoint_format = fmt
            trainer.save_checkpoint(path)


def evaluate(work: Path, ckpt_path: Path) -> float:
    """``trainer.test`` of a fresh module (one unit per layer) from ``ckpt_path``: the loss."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MMFSDP2Strategy(LAYERS, empty_init=False),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
    )
    trainer.test(Llava(), dataloaders=data(), ckpt_path=str(ckpt_path), verbose=False)
    return float(trainer.callback_metrics["test_loss"])


def fit(
    work: Path,
    name: str,
    strategy: Any,
    max_steps: int,
    devices: int = 2,
    ckpt_path: str | None = None,
    save_at_3: dict[str, Path] | None = None,
    batch_size: int = 2,
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, list[float]]:
    torch.manual_seed(0)
    callbacks: list[L.Callback] = [Record(work, name)]
    if save_at_3:
        callbacks.append(SaveAt(work, name, SAVE_AT, save_at_3))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=work,
        **trainer_kwargs,
    )
    trainer.fit(Llava(), train_dataloaders=data(batch_size), ckpt_path=ckpt_path)
    return trainer, callbacks[0].losses


# One FSDP unit per layer: the vision tower's unused last layer is a unit of its own, which receives no gradient
# at all (in a unit shared with used parameters it would receive zeros), so AdamW keeps no state for it.
LAYERS = {
    "sharding_size": "auto",
    "sub_modules_to_wrap": ["model.model.vision_tower.encoder.layers.{*}", "model.model.language_model.layers.{*}"],
}


def mm(plan: dict[str, Any] | None = None) -> MMFSDP2Strategy:
    """``plan`` None: one root unit, whose unused parameters get zero gradients as under DDP; torch's own
    optimizer implementation, as under DDP."""
    if plan is None:
        return MMFSDP2Strategy({"sharding_size": "auto"}, empty_init=False, fused_optimizer_step=False)
    return MMFSDP2Strategy(plan, empty_init=False)


def ddp() -> DDPStrategy:
    return DDPStrategy(find_unused_parameters=True, process_group_backend="gloo")


def dump(work: Path, name: str, rank: int, data: dict[str, Any]) -> None:
    (work / f"{name}.rank{rank}.json").write_text(json.dumps(data, indent=1))


@scenario
def two(work: Path) -> None:
    """2 ranks: DDP and mm_fsdp2 uninterrupted (saving at step 3); mm_fsdp2 resumed from each checkpoint."""
    out: dict[str, Any] = {}
    t, out["ddp"] = fit(work, "ddp", ddp(), STEPS, save_at_3={"ddp": work / "ddp.ckpt"})
    t, out["mm"] = fit(
        work, "mm", mm(LAYERS), STEPS, save_at_3={"torch_dcp": work / "mm.ckpt", "torch": work / "mm.pt"}
    )
    # Every checkpoint entry point inside a user's inference mode (state dicts of DTensors cannot be taken in it);
    # Lightning's parameter names in a keyword call.
    strategy = t.strategy
    strategy.checkpoint_format = "torch_dcp"  # SaveAt left it at "torch"
    with torch.inference_mode():
        state = {
            "state_dict": strategy.lightning_module_state_dict(),
            "global_step": t.global_step,
            "optimizer_states": [strategy.optimizer_state(o) for o in t.optimizers],
        }
        strategy.save_checkpoint(checkpoint=state, filepath=work / "keyword.ckpt", storage_options=None)
        t.save_checkpoint(work / "inference.ckpt")
        strategy.checkpoint_format = "torch"
        t.save_checkpoint(work / "inference.pt")
        out["inference_load_step"] = strategy.load_checkpoint(checkpoint_path=work / "inference.ckpt")["global_step"]
    # A standard (index-keyed) Lightning checkpoint moves to mm_fsdp2: model and optimiser state resume exactly.
    _, out["from_ddp"] = fit(work, "from_ddp", mm(), STEPS, ckpt_path=str(work / "ddp.ckpt"))
    # mm_fsdp2's own checkpoints (sharded and consolidated) resume strictly although some parameters have no
    # optimiser state (the vision tower's unused last layer).
    _, out["from_mm"] = fit(work, "from_mm", mm(LAYERS), STEPS, ckpt_path=str(work / "mm.ckpt"))
    _, out["from_mm_torch"] = fit(work, "from_mm_torch", mm(LAYERS), STEPS, ckpt_path=str(work / "mm.pt"))
    # Resharded 1 -> 2: the checkpoints of a 1-rank mm_fsdp2 run (scenario "pre"), in both formats.
    fit(work, "one_to_two", mm(LAYERS), SAVE_AT + 1, ckpt_path=str(work / "mm1.ckpt"))
    fit(work, "one_to_two_torch", mm(LAYERS), SAVE_AT + 1, ckpt_path=str(work / "mm1.pt"))
    # trainer.test from a checkpoint, as evaluation scripts write it: inside a user's inference mode too (the model
    # is built, sharded and run there), giving the loss it gives outside.
    out["test_loss"] = evaluate(work, work / "mm.ckpt")
    with torch.inference_mode():
        out["test_loss_inference_mode"] = evaluate(work, work / "mm.ckpt")
    dump(work, "two", t.global_rank, out)


@scenario
def pre(work: Path) -> None:
    """1 rank, before the 2-rank launch: mm_fsdp2 checkpoints at step 3 in both formats, for 1 -> 2."""
    fit(
        work,
        "mm1",
        mm(LAYERS),
        SAVE_AT,
        devices=1,
        batch_size=4,
        use_distributed_sampler=False,
        save_at_3={"torch_dcp": work / "mm1.ckpt", "torch": work / "mm1.pt"},
    )


@scenario
def one(work: Path) -> None:
    """1 rank: a single-device Lightning checkpoint resumes under mm_fsdp2; the 2-rank DDP and mm_fsdp2 checkpoints
    reshard onto one rank."""
    out: dict[str, Any] = {}
    # The plain loader's order on both sides (a ParallelStrategy would otherwise get a shuffling DistributedSampler);
    # batches of 4: step 3 ends the epoch, as on 2 ranks.
    single = dict(devices=1, batch_size=4, use_distributed_sampler=False)
    _, out["single"] = fit(work, "single", "auto", STEPS, save_at_3={"single": work / "single.ckpt"}, **single)
    _, out["from_single"] = fit(work, "from_single", mm(), STEPS, ckpt_path=str(work / "single.ckpt"), **single)
    _, out["ddp_to_one"] = fit(work, "ddp_to_one", mm(), SAVE_AT + 1, devices=1, ckpt_path=str(work / "ddp.ckpt"))
    _, out["mm_to_one"] = fit(work, "mm_to_one", mm(LAYERS), SAVE_AT + 1, devices=1, ckpt_path=str(work / "mm.ckpt"))
    fit(work, "mm_to_one_torch", mm(LAYERS), SAVE_AT + 1, devices=1, ckpt_path=str(work / "mm.pt"))
    dump(work, "one", 0, out)


# ------------------------------------------------------------------ Lightning's own round-trip tests, adapted
# Lightning's tests_pytorch/strategies/test_fsdp.py::test_strategy_load_optimizer_states and
# test_model_parallel_integration.py::test_load_standard_checkpoint_into_distributed_model, on CPU (gloo), with
# MMFSDP2Strategy in its defaults (the fused optimizer step on) and checkpoint_format="torch" (the gathered state
# on rank 0, as Lightning's full state dicts): a DDP checkpoint restored under it gives back the DDP run's model and
# optimizer state. Written as .pt files (rank 0 the state, other ranks what they got: nothing); the test compares
# them with torch.testing.assert_close(atol=0, rtol=0) as Lightning's tests do.
class RoundTripBoring(BoringModel):
    """test_fsdp.py's TestBoringModel: Linear(32, 32), ReLU, Linear(32, 2), AdamW(lr=0.1)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class FeedForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(torch.nn.functional.silu(self.w1(x)) * self.w2(x))


class RoundTripTemplate(L.LightningModule):
    """test_model_parallel_integration.py's TemplateModel: a SwiGLU feed-forward, AdamW's defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.model = FeedForward()

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch).sum()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters())


def _round_trip(work: Path, name: str, module: type[L.LightningModule], strategy: MMFSDP2Strategy) -> None:
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=2, max_epochs=1, default_root_dir=work / name)
    kwargs.update(logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = module()
    trainer = L.Trainer(strategy=DDPStrategy(process_group_backend="gloo"), **kwargs)
    trainer.fit(model)
    path = trainer.strategy.broadcast(str(work / f"{name}.last.ckpt"))
    trainer.save_checkpoint(path)
    saved = {
        "model": trainer.strategy.lightning_module_state_dict(),
        "optimizer": trainer.strategy.optimizer_state(model.optimizers()),
    }
    model = module()
    trainer = L.Trainer(strategy=strategy, barebones=True, **{k: v for k, v in kwargs.items() if k in _BAREBONES})
    trainer.fit(model, ckpt_path=path)
    restored = {
        "model": trainer.strategy.lightning_module_state_dict(),
        "optimizer": trainer.strategy.optimizer_state(model.optimizers()),
        "groups_now": [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizers[0].param_groups],
        "fused_groups": list(trainer.strategy.fused_steps.groups(trainer.optimizers[0])),
    }
    rank = trainer.global_rank
    torch.save({"saved": saved, "restored": restored}, work / f"{name}.roundtrip.rank{rank}.pt")
    trainer.strategy.barrier()


_BAREBONES = ("accelerator", "devices", "max_epochs", "default_root_dir")


@scenario
def lightning_round_trips(work: Path) -> None:
    """A DDP checkpoint restored under MMFSDP2Strategy: Lightning's two tests (see above), FSDP units per layer,
    per first layer only, and the root alone (test_fsdp.py's wrap_min_params 2, 1024 and 1e8)."""
    units = {"all": ["layer.0", "layer.2"], "half": ["layer.0"], "root": []}
    for name, wrap in units.items():
        plan = {"sharding_size": "auto", "sub_modules_to_wrap": wrap}
        _round_trip(work, f"boring_{name}", RoundTripBoring, MMFSDP2Strategy(plan, checkpoint_format="torch"))
    plan = {"sharding_size": "auto", "sub_modules_to_wrap": ["model.w1", "model.w2", "model.w3"]}
    _round_trip(work, "template", RoundTripTemplate, MMFSDP2Strategy(plan, checkpoint_format="torch"))


if __name__ == "__main__":
    scenario_kit.main()
