"""Wan VACE (MindSpeed MM's ``examples/vace``) through diffusers' ``WanVACETransformer3DModel`` (issue #36).

The 2-rank runs of the migrated corpus scripts against a one-process diffusers reference are in
``tests/test_wan.py`` (``test_migrated_vace_configs_train_like_the_diffusers_reference``). Here, fast: what
``migrate`` makes of the VACE model.json files and launch scripts, which parameters train (MindSpeed MM's
``VACEModel.freeze`` and its converter's split of the weights), MindSpeed MM's VACE FSDP2 YAML on diffusers'
module names, the VACE feature files as MindSpeed MM's ``FeatureDataset`` reads them, and the errors of bad input.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.scenarios.wan_scenarios import TINY_VACE, TINY_WAN

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "mindspeed_corpus"
SCRIPTS = {
    "examples/vace/1.3B/pretrain_fsdp.sh": {},
    "examples/vace/14B/pretrain_fsdp.sh": {},
    "examples/vace/A14B_wan2.2/pretrain_fsdp_high.sh": {"max_timestep_boundary": 0.358, "min_timestep_boundary": 0.0},
    "examples/vace/A14B_wan2.2/pretrain_fsdp_low.sh": {"max_timestep_boundary": 1, "min_timestep_boundary": 0.358},
}
"""Each VACE launch script and the timestep boundaries of its model.json's ``diffusion`` section (the Wan 2.2
A14B experts: high and low noise), as written there."""


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mindspeed_mm")
    shutil.copytree(CORPUS / "examples" / "vace", root / "examples" / "vace")
    return root


@pytest.fixture(scope="module")
def vace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import WanVACETransformer3DModel

    directory = tmp_path_factory.mktemp("vace_model")
    torch.manual_seed(0)
    WanVACETransformer3DModel(**TINY_VACE).save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------ migrate
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_vace_launch_scripts_migrate_to_the_diffusers_vace_path(tree: Path, script: str) -> None:
    from lightning_mm.mindspeed.load import migrate_file

    with _cwd(tree):
        result, _ = migrate_file(Path(script))
    args = result.config["model"]["init_args"]
    assert result.config["model"]["class_path"] == "lightning_mm.modules.wan_module.MMWanModule"
    # MindSpeed MM's VACEModel.freeze: wan_dit frozen, vace_dit trained; no weights directory named by the script
    assert args["diffusers_model"] == {"trainable": ["vace_patch_embedding", "vace_blocks"]}
    base = {"num_train_timesteps": 1000, "shift": 5, "sigma_min": 0.0, "extra_one_step": True}
    assert args["schedule"] == {**base, **SCRIPTS[script]}
    assert args["fsdp2_config"] == str(tree / "examples/vace/fsdp2_config.yaml")
    report = result.report()
    assert "predictor.model_id vace -> lightning_mm.modules.wan_module.MMWanModule with diffusers' " in report
    assert "WanVACETransformer3DModel" in report
    assert "predictor.vace_dit.vace_layers: a shape key" in report
    assert "predictor.vace_dit.vace_pretrained: null" in report
    assert "no weights directory (no --load, no `migrate --hf-path`)" in report


def test_vace_weights_come_from_hf_path_and_vace_pretrained_is_named(tree: Path, tmp_path: Path) -> None:
    from lightning_mm.mindspeed.diffusion import wan_module_config

    model = json.loads((tree / "examples/vace/1.3B/pretrain_model.json").read_text())
    out = wan_module_config(model, "m.json", str(tmp_path), "--hf-path")
    assert out.model["init_args"]["diffusers_model"] == {
        "init_from_path": str(tmp_path),
        "trainable": ["vace_patch_embedding", "vace_blocks"],
    }
    assert any("WanVACETransformer3DModel.save_pretrained" in m for m in out.mapped)
    model["predictor"]["vace_dit"]["vace_pretrained"] = "./vace.pt"
    model["predictor"]["vace_dit"]["vace_lyers"] = [0]
    out = wan_module_config(model, "m.json", None, "")
    assert any(u.startswith("predictor.vace_dit.vace_pretrained ./vace.pt: MindSpeed MM's own") for u in out.unmapped)
    assert "predictor.vace_dit.vace_lyers: unknown to lightning-mm migrate" in out.unmapped


# ------------------------------------------------------------------------------------ what trains
def _upstream_vace_dit(key: str) -> bool:
    """MindSpeed MM's ``checkpoint/sora_model/vace_converter.py`` (``_hf_to_mm_state``): a diffusers key containing
    ``vace`` goes to ``vace_dit`` (what ``VACEModel.freeze`` trains), every other one to ``wan_dit`` (frozen)."""
    return "vace" in key


def test_only_what_upstream_puts_in_vace_dit_trains(vace_dir: Path) -> None:
    from lightning_mm.diffusers import DiffusersModel
    from lightning_mm.diffusers.model import DiffusersModelConfigError
    from lightning_mm.mindspeed.diffusion import VACE_TRAINABLE

    model = DiffusersModel({"init_from_path": str(vace_dir), "trainable": VACE_TRAINABLE})
    assert type(model).__name__ == "WanVACETransformer3DModelFSDP"
    names = [n for n, _ in model.named_parameters()]
    assert any(_upstream_vace_dit(n) for n in names) and not all(_upstream_vace_dit(n) for n in names)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {n: _upstream_vace_dit(n) for n in names}
    assert model.default_fsdp2_config() == {"sub_modules_to_wrap": ["blocks.{*}", "vace_blocks.{*}"]}
    with pytest.raises(DiffusersModelConfigError, match=r"`trainable`.*vace_block.*resolves to no module"):
        DiffusersModel({"init_from_path": str(vace_dir), "trainable": ["vace_block"]})
    with pytest.raises(DiffusersModelConfigError, match="`trainable`: give either"):
        DiffusersModel({"init_from_path": str(vace_dir), "trainable": ["vace_blocks"], "freeze": ["blocks"]})


def test_mindspeeds_vace_fsdp2_yaml_names_diffusers_modules(vace_dir: Path) -> None:
    """MindSpeed MM's VACEModel holds ``wan_dit`` and ``vace_dit`` (``mindspeed_mm/models/predictor/dits/vace.py``);
    diffusers holds both parts at the top: the YAML's paths become the tiny model's blocks, head and VACE blocks."""
    from lightning_mm.core.config import FSDP2Config
    from lightning_mm.core.sharding_plan import build_plan
    from lightning_mm.diffusers import DiffusersModel, WanDiffusion
    from lightning_mm.diffusers.wan_diffusion import mindspeed_fsdp2_config

    config = mindspeed_fsdp2_config(CORPUS / "examples/vace/fsdp2_config.yaml")
    assert config["sub_modules_to_wrap"] == ["predictor.blocks.{*}", "predictor.proj_out", "predictor.vace_blocks.{*}"]
    target = WanDiffusion(DiffusersModel({"init_from_path": str(vace_dir)}))
    plan = build_plan(FSDP2Config.from_dict(config), target, 8)
    blocks = [f"predictor.blocks.{i}" for i in range(3)]
    vace = ["predictor.vace_blocks.0", "predictor.vace_blocks.1"]
    assert [u.modules[0] for u in plan.units] == [*blocks, *vace, "predictor.proj_out"]  # the model's order
    assert list(plan.recompute_modules) == [*blocks, *vace]


# ------------------------------------------------------------------------------------ the feature data
def _vace_features(
    folder: Path, keys: tuple[str, ...] = ("video", "prompt_ids", "prompt_mask", "vace_context")
) -> Path:
    """Two feature files as MindSpeed MM's ``get_vace_feature.py`` writes them (``_save_vace_sample_features``)."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "video": (4, 3, 8, 8),
        "prompt_ids": (5, 16),
        "vace_context": (72, 3, 8, 8),
    }
    for i in range(2):
        data = {k: torch.randn(shape, generator=generator) for k, shape in tensors.items() if k in keys}
        if "prompt_mask" in keys:
            data["prompt_mask"] = torch.tensor([1, 1, 1, 1, 0])
        torch.save(data, folder / f"{i}.pt")
    (folder / "data.jsonl").write_text("".join(json.dumps({"file": f"{i}.pt"}) + "\n" for i in range(2)))
    config = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {"data_path": str(folder / "data.jsonl"), "data_folder": str(folder)},
            "preprocess_parameters": {"video_processor_type": "VACEVideoProcessor", "num_frames": 81},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False, "drop_last": True},
    }
    (folder / "data.json").write_text(json.dumps(config))
    return folder / "data.json"


def _upstream_feature_sample(path: Path) -> dict[str, torch.Tensor]:
    """MindSpeed MM's ``mindspeed_mm/data/datasets/feature_dataset.py`` (``FeatureDataset.__getitem__``): ``video``,
    ``prompt_ids`` and ``prompt_mask`` popped into the example, every remaining key of the file added as it is
    (VACE's ``vace_context``, which ``SoraModel.forward`` passes on to ``VACEModel.forward`` in ``**kwargs``)."""
    feature_data = torch.load(path, weights_only=True)
    examples = {"video": feature_data.pop("video", None)}
    examples["prompt_ids"] = feature_data.pop("prompt_ids", None)
    examples["prompt_mask"] = feature_data.pop("prompt_mask", None)
    for key in feature_data.keys():
        examples[key] = feature_data[key]
    return examples


def test_vace_features_are_read_as_upstreams_feature_dataset(tmp_path: Path) -> None:
    from lightning_mm.datamodules import MMDataModule

    data = _vace_features(tmp_path / "f")
    dm = MMDataModule.from_config(data, batch_size=2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    upstream = [_upstream_feature_sample(tmp_path / "f" / f"{i}.pt") for i in range(2)]
    names = {"video": "latents", "prompt_ids": "prompt_embeds", "prompt_mask": "prompt_mask"}
    names["vace_context"] = "control_latents"  # VACEModel.forward's vace_context: diffusers' control_hidden_states
    assert sorted(batch) == sorted(names.values()) and sorted(upstream[0]) == sorted(names)
    for key, name in names.items():
        assert torch.equal(batch[name], torch.stack([u[key] for u in upstream])), key


def test_vace_features_without_vace_context_are_an_error_naming_file_and_key(tmp_path: Path) -> None:
    from lightning_mm.data.record_files import DataError
    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.mindspeed.feature_data import WanFeatureDataset

    data = _vace_features(tmp_path / "f", keys=("video", "prompt_ids", "prompt_mask"))
    with pytest.raises(DataError, match=r"f/0\.pt: no `vace_context` tensor") as err:
        MMDataModule.from_config(data, batch_size=1).setup("fit")
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"x\.pt: no `vace_context` tensor"):
        torch.save({"video": torch.zeros(4, 1, 2, 2), "prompt_ids": torch.zeros(2, 16)}, tmp_path / "x.pt")
        WanFeatureDataset([tmp_path / "x.pt"], strict=True, vace=True)[0]
    torch.save(
        {"video": torch.zeros(4, 1, 2, 2), "prompt_ids": torch.zeros(2, 16), "vace_context": torch.zeros(3)},
        tmp_path / "y.pt",
    )
    with pytest.raises(DataError, match=r"y\.pt: `vace_context` must be \(C, F, H, W\)"):
        WanFeatureDataset([tmp_path / "y.pt"], strict=True, vace=True)[0]


# ------------------------------------------------------------------------------------ the module
def test_the_control_latents_reach_the_vace_model_and_only_it(vace_dir: Path) -> None:
    """The step feeds ``control_latents`` and ``control_scale`` to diffusers' ``control_hidden_states`` /
    ``control_hidden_states_scale`` (one scale per VACE block, MindSpeed MM's ``vace_scale``)."""
    from lightning_mm.errors import ConfigError
    from lightning_mm.modules.wan_module import MMWanModule

    module = MMWanModule({"init_from_path": str(vace_dir)}, control_scale=0.5)
    module.configure_model()
    batch = {
        "latents": torch.randn(1, 4, 1, 4, 4),
        "prompt_embeds": torch.randn(1, 5, 16),
        "control_latents": torch.randn(1, 72, 1, 4, 4),
    }
    inputs = module.get_batch(batch)
    out = module.forward_step(inputs)
    expected = module.model.predictor(
        inputs["hidden_states"],
        inputs["timestep"],
        batch["prompt_embeds"],
        control_hidden_states=batch["control_latents"],
        control_hidden_states_scale=torch.tensor([0.5, 0.5]),
        return_dict=False,
    )[0]
    assert torch.equal(out, expected)
    full = module.model.predictor(
        inputs["hidden_states"],
        inputs["timestep"],
        batch["prompt_embeds"],
        control_hidden_states=batch["control_latents"],
        return_dict=False,
    )[0]
    assert not torch.allclose(out, full)  # the scale is applied (diffusers' default is 1 per block)
    with pytest.raises(KeyError, match=r"WanVACETransformer3DModelFSDP \(Wan VACE\): a batch needs `control_latents`"):
        module.get_batch({k: v for k, v in batch.items() if k != "control_latents"})
    wan = MMWanModule({"model_id": "wan", "config": TINY_WAN})
    wan.configure_model()
    with pytest.raises(KeyError, match="`control_latents` .* given, but the model is WanTransformer3DModelFSDP"):
        wan.get_batch(batch)
    with pytest.raises(ConfigError, match="`control_scale` must be a number"):
        MMWanModule({"model_id": "wan", "config": TINY_WAN}, control_scale="1")
