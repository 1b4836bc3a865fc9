"""A model built by ``TransformersModel`` checks every call itself (a forward pre-hook, lightning_mm/hf/batch_check.py):
a VLM batch with a misnamed image key or too few image placeholders stops before step 1 whichever code calls the
model: MindSpeed MM's ``forward_step=``, an overriding ``forward_step``, a plain LightningModule, ``generate``. The
2-rank ``MMFSDP2Strategy`` run (the hook after ``fully_shard``, with recomputation and meta-device init) is at the
end."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_mm import MMLightningModule
from lightning_mm.hf import batch_check
from lightning_mm.hf.batch_check import BatchCheckError, has_batch_check, install_batch_check
from lightning_mm.modules import TransformersModel
from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import batch_check_scenarios
from tests.scenarios.batch_check_scenarios import BROKEN, VISION, LlavaData, llava, seed_forward_step
from tests.scenarios.hf_scenarios import IMAGE_TOKEN, FamilyData, model_inputs, tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]


class Overriding(MMLightningModule):
    def model_provider(self) -> torch.nn.Module:
        return llava()

    def forward_step(self, batch: Any) -> Any:
        return self.model(**batch)


class Plain(L.LightningModule):
    """A LightningModule of the user's own that wraps a TransformersModel."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llava()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _module(path: str) -> L.LightningModule:
    torch.manual_seed(0)
    if path == "seed":
        module = MMLightningModule(model_provider=llava, forward_step=seed_forward_step, lr=1e-2, log_throughput=False)
    elif path == "override":
        module = Overriding(lr=1e-2, log_throughput=False)
    else:
        return Plain()
    module.configure_model()
    return module


def _trainer(tmp_path: Path, steps: int = 1) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )


def _loader(broken: str | None = None) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(LlavaData(broken), batch_size=2)


@pytest.mark.parametrize("path", ["seed", "override", "plain"])
def test_every_path_stops_before_step_one_and_a_correct_batch_trains(tmp_path, path):
    module = _module(path)
    assert has_batch_check(module.model)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    for broken, message in BROKEN.items():
        trainer = _trainer(tmp_path)
        with pytest.raises(BatchCheckError, match=message):
            trainer.fit(module, train_dataloaders=_loader(broken))
        assert trainer.global_step == 0
        assert all(torch.equal(p, before[n]) for n, p in module.model.named_parameters())
    with pytest.raises(BatchCheckError, match=BROKEN["placeholders"]):  # the first validation batch is checked
        _trainer(tmp_path).validate(module, dataloaders=_loader("placeholders"))

    good = _trainer(tmp_path)
    good.fit(module, train_dataloaders=_loader())
    assert good.global_step == 1
    assert not torch.equal(module.model.get_parameter(VISION), before[VISION])  # the images were used


def test_positional_input_ids_are_checked():
    model = llava().eval()
    batch = model_inputs(torch.utils.data.default_collate([FamilyData("llava")[0]]))
    with torch.no_grad():
        model(batch["input_ids"], batch["pixel_values"])  # input_ids, pixel_values by position: consistent
        with pytest.raises(BatchCheckError, match="holds 4 image placeholder tokens .* has no `pixel_values`"):
            model(batch["input_ids"])


def _qwen3_vl() -> torch.nn.Module:
    from tests.helpers.qwen3_vl_family import CONFIG

    return TransformersModel({"hf_config": {"model_type": "qwen3_vl", **CONFIG}})


def _generate_inputs(family: str) -> dict[str, torch.Tensor]:
    from tests.helpers.qwen3_vl_family import Qwen3VLData

    data = Qwen3VLData() if family == "qwen3_vl" else FamilyData(family)
    batch = model_inputs(torch.utils.data.default_collate([data[0], data[1]]))
    batch.pop("labels")
    return batch


@pytest.mark.parametrize("family", ["llava", "qwen3_vl"])
def test_generate_runs_through_the_check_and_equals_transformers(family):
    """generate() calls forward with its own keys (``cache``, ``use_cache``, ``return_dict``, the pre-encoded
    ``mm_encoder_outputs``, ...): the check takes them, and a prompt whose images have no placeholder still stops."""
    import transformers

    torch.manual_seed(0)
    model = (_qwen3_vl() if family == "qwen3_vl" else llava()).eval()
    arch = "Qwen3VLForConditionalGeneration" if family == "qwen3_vl" else "LlavaForConditionalGeneration"
    reference = getattr(transformers, arch)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    inputs = _generate_inputs(family)
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    no_placeholders = {**inputs, "input_ids": inputs["input_ids"].masked_fill(inputs["input_ids"] == IMAGE_TOKEN, 11)}
    if "mm_token_type_ids" in inputs:
        no_placeholders["mm_token_type_ids"] = torch.zeros_like(inputs["mm_token_type_ids"])
    with pytest.raises(BatchCheckError, match="encoded images .* input_ids holds no image placeholder token"):
        model.generate(**no_placeholders, **options)  # the first prompt of its kind is checked in full

    out = model.generate(**inputs, **options)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    assert torch.equal(out, reference.generate(**inputs, **options))


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[frozenset[str]]:
    calls: list[frozenset[str]] = []
    check = batch_check.check_batch

    def counted(model: torch.nn.Module, batch: Any) -> None:
        calls.append(frozenset(batch))
        check(model, batch)

    monkeypatch.setattr(batch_check, "check_batch", counted)
    return calls


@pytest.mark.parametrize("built_by", ["TransformersModel", "Transformers"])
def test_the_default_forward_step_checks_once_per_kind_of_batch(tmp_path, monkeypatch, built_by):
    """One full check for three training steps, whether the hook (a TransformersModel) or the default
    ``forward_step`` (any other Transformers model) runs it: never both."""
    calls = _counting(monkeypatch)

    def provider() -> torch.nn.Module:
        return llava() if built_by == "TransformersModel" else tiny_hf_model("llava").train()

    module = MMLightningModule(model_provider=provider, lr=1e-2, log_throughput=False)
    trainer = _trainer(tmp_path, steps=3)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(LlavaData(), batch_size=1))
    assert trainer.global_step == 3
    assert len(calls) == 1
    assert has_batch_check(module.model) == (built_by == "TransformersModel")


def test_install_is_idempotent_and_its_handle_takes_the_check_off():
    model = tiny_hf_model("llava")
    handle = install_batch_check(model)
    assert install_batch_check(model) is handle and has_batch_check(model)
    batch = model_inputs(torch.utils.data.default_collate([LlavaData("images_key")[0]]))
    with torch.no_grad(), pytest.raises(BatchCheckError, match="'images'"):
        model(**batch)
    handle.remove()
    assert not has_batch_check(model)
    with torch.no_grad():
        model(**batch)  # unchecked: Transformers swallows `images` and runs on the text alone


# ------------------------------------------------------------------------------ 2 ranks, MMFSDP2Strategy
def test_two_ranks_under_fsdp2_train_and_stop_before_step_one(tmp_path):
    run(batch_check_scenarios.fits, tmp_path, timeout=600)
    ranks = read_results(tmp_path, "fits")
    for rank in ranks:
        seen = rank["images_key"]
        assert seen["error"] == "BatchCheckError" and seen["global_step"] == 0, seen
        assert re.search(BROKEN["images_key"], seen["message"]), seen
        good = rank["good"]
        assert good["model_class"] == "MMLlavaForConditionalGeneration" and good["checked"]  # its units are sharded
        assert good["global_step"] == 2 and good["recomputed"]
        assert len(good["losses"]) == 2 and all(map(math.isfinite, good["losses"]))
        assert good["full_checks"] == 1  # the first step, in full; the second step a set lookup
        assert good["vision_changed"]
        wrapped = rank["wrapped"]
        assert wrapped["model_class"] == "FSDPMMLlavaForConditionalGeneration"
        assert wrapped["error"] is not None and re.search(BROKEN["images_key"], wrapped["error"]), wrapped
        assert math.isclose(wrapped["loss"], wrapped["reference_loss"], rel_tol=1e-5) and wrapped["grad_equal"]
