"""A VLM never trains without its images: batch keys, image placeholders and Qwen's M-RoPE inputs are checked
before the model runs a batch (lightning_mm/hf/batch_check.py); a fit stops before its first step. Where the check
runs (the hook on every TransformersModel, on every calling path): tests/test_batch_check_hook.py."""

from __future__ import annotations

import pytest
import torch

from lightning_mm.hf.batch_check import BatchCheck, BatchCheckError, check_batch, forward_keys
from tests.helpers.qwen3_vl_family import Qwen3VLData, tiny_qwen3_vl
from tests.scenarios.hf_scenarios import FamilyData, model_inputs, tiny_hf_model

VIDEO_TOKEN = 6


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    built = {f: tiny_hf_model(f) for f in ("llava", "internvl", "qwen2_5_vl", "llama_tied")}
    built["qwen3_vl"] = tiny_qwen3_vl()
    return built


def _batch(family: str) -> dict[str, torch.Tensor]:
    data = Qwen3VLData() if family == "qwen3_vl" else FamilyData(family)
    return model_inputs(torch.utils.data.default_collate([data[0], data[1]]))


@pytest.mark.parametrize("family", ["llava", "internvl", "qwen2_5_vl", "qwen3_vl", "llama_tied"])
def test_correct_batches_pass_and_the_model_takes_them(models, family):
    batch = _batch(family)
    check_batch(models[family], batch)
    with torch.no_grad():
        assert torch.isfinite(models[family](**batch).loss)


def test_a_key_the_model_does_not_take_is_named_with_what_it_takes(models):
    batch = _batch("llava")
    batch["images"] = batch.pop("pixel_values")
    batch["input_ids"][batch["input_ids"] == 5] = 11  # a text-only batch with a stray image key
    with pytest.raises(
        BatchCheckError,
        match=r"batch key\(s\) 'images' are not taken by LlavaForConditionalGeneration"
        r".*It takes: .*pixel_values.* \(and the keyword arguments .*\)$",
    ):
        check_batch(models["llava"], batch)
    with torch.no_grad():  # what the check prevents: Transformers trains on the text alone, without an error
        models["llava"](**batch)


def test_keys_of_the_inner_model_and_typed_kwargs_are_taken(models):
    keys = forward_keys(models["qwen3_vl"])
    assert {"pixel_values", "image_grid_thw", "mm_token_type_ids", "labels", "attention_mask"} <= keys
    assert {"cu_seq_lens_q", "max_length_q", "num_items_in_batch"} <= keys  # Unpack[TransformersKwargs]
    assert "images" not in keys and "kwargs" not in keys
    batch = _batch("llama_tied")
    check_batch(models["llama_tied"], {**batch, "num_items_in_batch": torch.tensor(10)})


@pytest.mark.parametrize("family", ["llava", "internvl", "qwen2_5_vl", "qwen3_vl"])
def test_images_without_their_placeholders_are_an_error(models, family):
    batch = _batch(family)
    batch["input_ids"][batch["input_ids"] == 5] = 11
    if "mm_token_type_ids" in batch:
        batch["mm_token_type_ids"].zero_()
    with pytest.raises(
        BatchCheckError,
        match=r"make \d+ image tokens but input_ids holds 0 image placeholder tokens "
        r"\(image_token_id 5\)",
    ):
        check_batch(models[family], batch)


@pytest.mark.parametrize(
    "family,expected,given", [("llava", 8, 7), ("internvl", 2, 1), ("qwen2_5_vl", 2, 1), ("qwen3_vl", 12, 11)]
)
def test_placeholder_count_must_equal_the_tokens_the_images_make(models, family, expected, given):
    batch = _batch(family)
    first = int((batch["input_ids"][0] == 5).nonzero()[0])
    batch["input_ids"][0, first] = 11  # one placeholder too few
    if "mm_token_type_ids" in batch:
        batch["mm_token_type_ids"][0, first] = 0
    with pytest.raises(BatchCheckError, match=f"make {expected} image tokens but input_ids holds {given} image"):
        check_batch(models[family], batch)


def test_qwen_image_tokens_follow_the_grid(models):
    """Qwen-VL: prod(image_grid_thw) / spatial_merge_size**2 tokens per image (4 + 2 per Qwen3VLData sample)."""
    batch = _batch("qwen3_vl")
    batch["image_grid_thw"] = batch["image_grid_thw"].clone()
    batch["image_grid_thw"][0] = torch.tensor([1, 2, 8])  # same patch count, same tokens: still consistent
    check_batch(models["qwen3_vl"], batch)
    batch["image_grid_thw"][1] = torch.tensor([1, 4, 4])  # 2 tokens more than the placeholders
    with pytest.raises(BatchCheckError, match="make 14 image tokens but input_ids holds 12"):
        check_batch(models["qwen3_vl"], batch)


def test_placeholders_without_images_are_an_error(models):
    batch = _batch("qwen3_vl")
    for key in ("pixel_values", "image_grid_thw"):
        batch.pop(key)
    with pytest.raises(BatchCheckError, match="input_ids holds 12 image placeholder tokens .* has no `pixel_values`"):
        check_batch(models["qwen3_vl"], batch)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_images_need_mm_token_type_ids_or_3d_positions(models, family):
    batch = _batch(family)
    types = batch.pop("mm_token_type_ids")
    with pytest.raises(BatchCheckError, match="neither `mm_token_type_ids` nor 3-D `position_ids`"):
        check_batch(models[family], batch)
    with pytest.raises(BatchCheckError, match="neither"):  # 1-D positions are what Qwen2.5-VL falls back to
        check_batch(models[family], {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]})
    positions, _ = models[family].model.get_rope_index(
        batch["input_ids"], types, batch["image_grid_thw"], attention_mask=batch["attention_mask"]
    )
    check_batch(models[family], {**batch, "position_ids": positions})
    wrong = types.clone()
    wrong[0, 0] = 1
    with pytest.raises(
        BatchCheckError,
        match="mm_token_type_ids marks 3 image tokens .* holds 2"
        if family == "qwen2_5_vl"
        else "mm_token_type_ids marks 13 image tokens .* holds 12",
    ):
        check_batch(models[family], {**batch, "mm_token_type_ids": wrong})


def test_qwen_video_tokens_are_counted(models):
    batch = _batch("qwen2_5_vl")
    videos = {"pixel_values_videos": torch.randn(8, 1176), "video_grid_thw": torch.tensor([[2, 2, 2]])}
    with pytest.raises(BatchCheckError, match="videos make 2 video tokens but input_ids holds 0 video placeholder"):
        check_batch(models["qwen2_5_vl"], {**batch, **videos})
    ids = batch["input_ids"].clone()
    ids[1, 10:12] = VIDEO_TOKEN
    types = batch["mm_token_type_ids"].clone()
    types[1, 10:12] = 2
    check_batch(models["qwen2_5_vl"], {**batch, **videos, "input_ids": ids, "mm_token_type_ids": types})


def test_non_transformers_models_are_not_checked():
    check_batch(torch.nn.Linear(2, 2), {"anything": torch.zeros(1)})


def test_batch_check_checks_each_kind_of_batch_once(models):
    check = BatchCheck()
    good, bad = _batch("llava"), _batch("llava")
    bad["input_ids"][bad["input_ids"] == 5] = 11
    check(models["llava"], good, "train")
    check(models["llava"], bad, "train")  # same stage and keys: not counted again (cheap)
    with pytest.raises(BatchCheckError):
        check(models["llava"], bad, "validate")  # the first batch of another stage is
    with pytest.raises(BatchCheckError, match="'images'"):
        check(models["llava"], {**good, "images": good["pixel_values"]}, "train")  # another key set is


class _Renamed(torch.utils.data.Dataset):
    """LLaVA samples whose image key is ``images`` (what the model does not take)."""

    def __init__(self) -> None:
        self.data = FamilyData("llava")

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = dict(self.data[i])
        sample["images"] = sample.pop("pixel_values")
        return sample


def test_fit_stops_before_the_first_step_and_a_correct_batch_trains(tmp_path):
    import lightning as L

    from lightning_mm import MMLightningModule
    from lightning_mm.modules import TransformersModel
    from tests.scenarios.hf_scenarios import FAMILIES

    def provider() -> torch.nn.Module:
        return TransformersModel({"hf_config": {"model_type": "llava", **FAMILIES["llava"][1]}})

    def trainer() -> L.Trainer:
        return L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=tmp_path,
        )

    torch.manual_seed(0)
    module = MMLightningModule(model_provider=provider, lr=1e-2, log_throughput=False)
    bad = trainer()
    with pytest.raises(BatchCheckError, match="'images' are not taken by MMLlavaForConditionalGeneration"):
        bad.fit(module, train_dataloaders=torch.utils.data.DataLoader(_Renamed(), batch_size=2))
    assert bad.global_step == 0
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    with pytest.raises(BatchCheckError, match="'images'"):
        trainer().validate(module, dataloaders=torch.utils.data.DataLoader(_Renamed(), batch_size=2))
    assert all(torch.equal(p, before[n]) for n, p in module.model.named_parameters())

    good = trainer()
    good.fit(module, train_dataloaders=torch.utils.data.DataLoader(FamilyData("llava"), batch_size=2))
    assert good.global_step == 2
    vision = "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(module.model.get_parameter(vision), before[vision])  # the images were used
