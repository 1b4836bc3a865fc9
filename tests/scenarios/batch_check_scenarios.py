"""2-rank fits of a ``TransformersModel`` LLaVA under ``MMFSDP2Strategy``, driven by a seed-style ``forward_step``:

    python tests/scenarios/batch_check_scenarios.py fits OUTDIR     (tests/helpers/scenario_kit.py)

A fit on correct batches trains two steps with recomputation, the model built on the meta device and wrapped by
``fully_shard``, checked in full once; then a fit on batches whose image key is misnamed must stop at the first
forward on every rank with ``BatchCheckError``. In between, the model itself wrapped by ``fully_shard`` is called
directly (see :func:`_wrapped_model`). Each rank writes what it saw to ``OUTDIR/fits.rank{R}.json``. Also the
helpers of tests/test_batch_check_hook.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario, write_result  # noqa: E402
from tests.scenarios.hf_scenarios import FAMILIES, FamilyData  # noqa: E402

VISION = "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"
BROKEN = {
    "images_key": r"batch key\(s\) 'images' are not taken by (FSDP)?MMLlavaForConditionalGeneration",
    "placeholders": "the batch's images make 8 image tokens but input_ids holds 6 image placeholder tokens",
}


def llava() -> torch.nn.Module:
    from lightning_mm.modules import TransformersModel

    return TransformersModel({"hf_config": {"model_type": "llava", **FAMILIES["llava"][1]}})


class LlavaData(torch.utils.data.Dataset):
    """Tiny LLaVA samples (4 placeholder tokens per 28x28 image), optionally broken as a user's data may be."""

    def __init__(self, broken: str | None = None) -> None:
        self.data, self.broken = FamilyData("llava"), broken

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = dict(self.data[i])
        if self.broken == "images_key":  # what the model does not take: it would train on the text alone
            sample["images"] = sample.pop("pixel_values")
        elif self.broken == "placeholders":  # one placeholder too few per sample: 8 image tokens, 6 per batch of 2
            sample["input_ids"] = sample["input_ids"].clone()
            sample["input_ids"][1] = 11
        return sample


def _seed_loss(output: Any) -> torch.Tensor:
    return output.loss


def seed_forward_step(data_iterator: Any, model: torch.nn.Module) -> Any:
    """A MindSpeed MM ``pretrain_xxx.py`` forward_step: the batch straight into the model."""
    batch = next(data_iterator)
    return model(**batch), _seed_loss


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _wrapped_model(mesh: Any, loader: Any) -> dict[str, Any]:
    """The model itself wrapped by ``fully_shard`` (a user's own sharding, or Lightning's ModelParallelStrategy):
    FSDP2 swaps its class and puts its own pre-forward hook first; the check still runs, and the model computes
    what the unwrapped one does."""
    from torch.distributed.fsdp import fully_shard

    from lightning_mm.hf.batch_check import BatchCheckError

    torch.manual_seed(0)
    model, reference = llava(), llava()
    reference.load_state_dict(model.state_dict())
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen: dict[str, Any] = {"model_class": type(model).__name__}
    bad = next(iter(loader("images_key")))  # no sampler: the same batch on every rank
    try:
        model(**bad)
        seen["error"] = None
    except BatchCheckError as err:
        seen["error"] = str(err)
    batch = next(iter(loader()))
    loss = model(**batch).loss
    loss.backward()
    expected = reference(**batch).loss
    expected.backward()
    seen["loss"], seen["reference_loss"] = float(loss), float(expected)
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    seen["grad_equal"] = bool(
        torch.allclose(_full(model.get_parameter(name).grad), reference.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
    )
    return seen


@scenario
def fits(outdir: Path) -> None:
    import lightning as L

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.core.recompute import is_recomputed
    from lightning_mm.hf import batch_check

    def module() -> MMLightningModule:
        torch.manual_seed(0)
        return MMLightningModule(model_provider=llava, forward_step=seed_forward_step, lr=1e-2, log_throughput=False)

    def trainer(steps: int, callbacks: list[L.Callback] = ()) -> L.Trainer:
        strategy = MMFSDP2Strategy(
            {"sharding_size": "auto", "recompute_modules": ["model.language_model.layers.{*}"], "use_reentrant": False}
        )
        return L.Trainer(
            accelerator="cpu",
            devices=2,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            strategy=strategy,
            callbacks=list(callbacks),
        )

    def loader(broken: str | None = None) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(LlavaData(broken), batch_size=2)

    calls: list[int] = []
    check = batch_check.check_batch

    def counted(model: torch.nn.Module, batch: Any) -> None:
        calls.append(1)
        check(model, batch)

    batch_check.check_batch = counted
    good: dict[str, Any] = {"losses": []}

    class Record(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            model = pl_module.model
            good["model_class"] = type(model).__name__
            good["checked"] = batch_check.has_batch_check(model)
            good["recomputed"] = is_recomputed(model.get_submodule("model.language_model.layers.0"))
            good["vision_before"] = _full(model.get_parameter(VISION).detach()).clone()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            good["losses"].append(float(outputs["loss"].detach()))

    model, run = module(), trainer(2, [Record()])
    run.fit(model, train_dataloaders=loader())
    batch_check.check_batch = check
    good["global_step"] = run.global_step
    good["full_checks"] = len(calls)
    before = good.pop("vision_before")
    good["vision_changed"] = not torch.equal(_full(model.model.get_parameter(VISION).detach()), before)
    results: dict[str, Any] = {"good": good, "wrapped": _wrapped_model(run.strategy.device_mesh, loader)}
    # Then a fit on batches whose image key is misnamed (on every rank: a rank that raised alone would leave the
    # others in a collective). Last: a failed run destroys the process group (MMFSDP2Strategy.teardown).
    bad = trainer(1)
    try:
        bad.fit(module(), train_dataloaders=loader("images_key"))
        results["images_key"] = {"error": None, "global_step": bad.global_step}
    except batch_check.BatchCheckError as err:
        results["images_key"] = {"error": type(err).__name__, "message": str(err), "global_step": bad.global_step}
    write_result(outdir, "fits", results, run.global_rank)


if __name__ == "__main__":
    scenario_kit.main()
