"""MindSpeed MM's own feature output loads as ``dataset_type: feature``: its ``data.jsonl`` records (as
``mindspeed_mm/tools/feature_extraction/get_sora_feature.py``'s ``_write_data_info`` writes them) and its i2v feature
keys (``mindspeed_mm/utils/extra_processor/wan_i2v_processor.py``), read as MindSpeed MM's ``FeatureDataset``
(``mindspeed_mm/data/datasets/feature_dataset.py``) reads them: only ``file`` names what is loaded."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from tests.scenarios.wan_scenarios import TINY_WAN


def _safe_filename(file_path: str) -> str:
    """Re-told from ``get_sora_feature.py``'s ``FeatureExtractor._generate_safe_filename``."""
    return os.path.basename(file_path).replace(".", "_") + ".pt"


def _write_data_info(save_path: Path, data_samples: list[dict]) -> None:
    """Re-told from ``get_sora_feature.py``'s ``FeatureExtractor._write_data_info`` in ``data_storage_mode:
    combine`` (``source_file_key = "path"``): each sample as the dataset holds it (``DataFileReader._change_path``
    joined the ``data.txt`` folder to its ``path``), plus ``file`` = ``features/<safe name>``."""
    with open(save_path / "data.jsonl", "w", encoding="utf-8") as json_file:
        for data_sample in data_samples:
            pt_name = _safe_filename(data_sample["path"])
            data_info = copy.deepcopy(data_sample)
            data_info["file"] = f"features/{pt_name}"
            json_file.write(json.dumps(data_info) + "\n")


def _feature_config(root: Path, out: Path) -> Path:
    # MindSpeed MM's feature_data.json: dataset_type feature, data_path the written data.jsonl, data_folder its folder
    config = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {"data_path": str(out / "data.jsonl"), "data_folder": str(out)},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False},
    }
    (root / "feature_data.json").write_text(json.dumps(config))
    return root / "feature_data.json"


def _samples(video_folder: str) -> list[dict]:
    # DataFileReader (combine): `path` = os.path.join(folder as written in data.txt, the annotation's path)
    return [
        {"path": os.path.join(video_folder, name), "cap": cap}
        for name, cap in (("one.mp4", "a red clip"), ("dir/two.v2.mp4", "the sea"))
    ]


def test_mindspeeds_own_data_jsonl_loads(tmp_path: Path) -> None:
    """Its records keep the absolute source video in ``path`` (outside ``data_folder``, and not there at all): it is
    metadata, only ``file`` is read, as in MindSpeed MM's ``FeatureDataset.__getitem__``."""
    from lightning_mm.datamodules import MMDataModule

    out = tmp_path / "features_out"
    (out / "features").mkdir(parents=True)
    samples = _samples("/data/videos")
    _write_data_info(out, samples)
    generator = torch.Generator().manual_seed(0)
    saved = []
    for sample in samples:
        data = {
            "video": torch.randn(4, 2, 4, 4, generator=generator),
            "prompt_ids": torch.randn(5, 16, generator=generator),
            "prompt_mask": torch.tensor([1, 1, 1, 0, 0]),
        }
        torch.save(data, out / "features" / _safe_filename(sample["path"]))
        saved.append(data)
    dm = MMDataModule.from_config(_feature_config(tmp_path, out), batch_size=1)
    dm.setup("fit")
    assert dm.reports["train"].problems == []
    batches = list(dm.train_dataloader())
    assert len(batches) == 2
    for batch, data in zip(batches, saved):
        assert torch.equal(batch["latents"][0], data["video"])
        assert torch.equal(batch["prompt_embeds"][0], data["prompt_ids"])
        assert torch.equal(batch["prompt_mask"][0], data["prompt_mask"])


def test_mindspeeds_i2v_features_train_as_its_wan_dit_consumes_them(tmp_path: Path) -> None:
    """``wan_i2v_processor.py`` saves ``i2v_clip_feature`` (CLIP ``hidden_states[-2]``) and ``i2v_vae_feature``
    (first-frame mask and latents on the channels); MindSpeed MM's ``WanDiT.forward``
    (``mindspeed_mm/models/predictor/dits/wan_dit.py``) concatenates the latter to the noisy latents and embeds the
    former with ``img_emb``: diffusers' ``WanTransformer3DModel`` called with the concatenation and
    ``encoder_hidden_states_image`` gives the same loss and gradients as the training step on the feature file."""
    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.modules.wan_module import MMWanModule

    out = tmp_path / "features_out"
    (out / "features").mkdir(parents=True)
    samples = _samples(str(tmp_path / "videos"))[:1]
    _write_data_info(out, samples)
    generator = torch.Generator().manual_seed(1)
    data = {
        "video": torch.randn(4, 2, 4, 4, generator=generator),
        "prompt_ids": torch.randn(512, 16, generator=generator),
        "prompt_mask": torch.ones(512, dtype=torch.long),
        "i2v_clip_feature": torch.randn(3, 16, generator=generator),
        "i2v_vae_feature": torch.randn(8, 2, 4, 4, generator=generator),  # 4 mask channels + 4 latent channels
    }
    torch.save(data, out / "features" / _safe_filename(samples[0]["path"]))
    i2v = {**TINY_WAN, "in_channels": 12, "image_dim": 16, "added_kv_proj_dim": 24}
    dm = MMDataModule.from_config(_feature_config(tmp_path, out), batch_size=1)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert sorted(batch) == ["condition_latents", "image_embeds", "latents", "prompt_embeds", "prompt_mask"]
    torch.manual_seed(0)
    module = MMWanModule({"model_id": "wan", "config": i2v}, noise_seed=3)
    module.configure_model()
    inputs = module.get_batch(batch)
    loss = module.loss_func(module.forward_step(inputs), inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    predictor = module.model.predictor
    prediction = predictor(
        torch.cat([inputs["hidden_states"], data["i2v_vae_feature"][None]], 1),
        inputs["timestep"],
        data["prompt_ids"][None],
        data["i2v_clip_feature"][None],
        return_dict=False,
    )[0]
    expected = module.schedule.loss(prediction, inputs["flow"])
    expected.backward()
    assert loss > 0 and torch.allclose(loss, expected, rtol=1e-5), (loss, expected)
    assert predictor.condition_embedder.image_embedder.ff.net[0].proj.weight.grad.abs().sum() > 0
    for name, param in module.named_parameters():
        if param.grad is not None:
            assert torch.allclose(grads[name], param.grad, rtol=1e-5, atol=1e-7), name


def test_two_keys_for_one_sample_key_are_an_error(tmp_path: Path) -> None:
    """MindSpeed MM's ``i2v_clip_feature`` and this project's ``image_embeds`` both give ``image_embeds``: a file
    with both is refused, naming it, rather than one silently winning."""
    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.errors import DataError

    out = tmp_path / "features_out"
    (out / "features").mkdir(parents=True)
    samples = _samples("/data/videos")[:1]
    _write_data_info(out, samples)
    data = {
        "video": torch.zeros(4, 1, 2, 2),
        "prompt_ids": torch.zeros(3, 16),
        "i2v_clip_feature": torch.zeros(3, 16),
        "image_embeds": torch.ones(3, 16),
    }
    torch.save(data, out / "features" / _safe_filename(samples[0]["path"]))
    dm = MMDataModule.from_config(_feature_config(tmp_path, out), batch_size=1)
    dm.setup("fit")
    with pytest.raises(DataError):
        next(iter(dm.train_dataloader()))
    assert "both give `image_embeds`" in dm.reports["train"].problems[0]
