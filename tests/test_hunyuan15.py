"""HunyuanVideo 1.5 through diffusers (issue #36, item 3).

The corpus' ``examples/hunyuanvideo_1.5/{t2v,i2v}/pretrain_hunyuanvideo_15.sh``, migrated and run by ``lightning-mm
fit --config`` on 2 gloo ranks (``tests/scenarios/hunyuan15_scenarios.py``) with a tiny diffusers
``HunyuanVideo15Transformer3DModel`` and features in MindSpeed MM's layout (two text encoders; i2v's condition
latents and image states), equal a one-process diffusers reference with the same samples, noise and timesteps (its
own re-telling of MindSpeed MM's ``mindspeed_mm/models/diffusion/hunyuan_video_15_scheduler.py``). The rest: the
schedule against that re-telling, the feature layout, MindSpeed MM's FSDP2 YAML, the batch checks, the migrated
configs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import scenario_kit
from tests.scenarios import hunyuan15_scenarios as hy
from tests.scenarios.hunyuan15_scenarios import reference_losses, write_workdir

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "mindspeed_corpus"
HY = CORPUS / "examples" / "hunyuanvideo_1.5"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hunyuan15_work")
    write_workdir(directory)
    return directory


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("mindspeed_mm")  # a MindSpeed MM checkout: the corpus' examples/
    shutil.copytree(CORPUS / "examples" / "hunyuanvideo_1.5", tree / "examples" / "hunyuanvideo_1.5")
    return tree


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, work: Path, tree: Path) -> Path:
    out = tmp_path_factory.mktemp("hunyuan15_run")
    hy.write_migrated(work, tree, out)
    scenario_kit.run(hy.fit_migrated, out, args={"work": work})
    return out


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("task", sorted(hy.SCRIPTS))
def test_the_migrated_scripts_train_like_the_diffusers_reference(run: Path, work: Path, task: str) -> None:
    """2 steps on 2 ranks from the migrated corpus config (MindSpeed MM's FSDP2 YAML: each dual-stream block a unit,
    recomputed): the losses and the first step's gradients equal the one-process diffusers reference to relative
    1e-5, the final weights to Adam's first-step tolerance."""
    ranks = [json.loads((run / f"{task}.rank{r}.json").read_text()) for r in range(2)]
    blocks = ["predictor.transformer_blocks.0", "predictor.transformer_blocks.1"]
    assert ranks[0]["plan"] == {"units": blocks, "recompute": blocks}
    losses = [(ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 for s in range(hy.STEPS)]
    grads: dict[str, torch.Tensor] = {}
    expected, weights = reference_losses(work, hy.STEPS, task, grads=grads)
    assert all(_close(a, b) for a, b in zip(losses, expected)), (losses, expected)
    got = torch.load(run / f"{task}_grads.pt", weights_only=True)
    unused = sorted(set(got) - set(grads))  # the last block's text-stream output, which nothing reads: None there
    assert set(grads) <= set(got) and all(not got[k].any() for k in unused), unused
    assert len(unused) == 6, unused
    scale = max(ref.abs().max().item() for ref in grads.values())
    for key, ref in grads.items():  # before Adam, which would hide a scale error
        assert torch.allclose(got[key], ref, rtol=1e-5, atol=1e-6 * scale), key
    final = torch.load(run / f"{task}_final.pt", weights_only=True)
    assert sorted(final) == sorted(weights)
    for key, ref in weights.items():
        error = ((final[key] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert error <= 1e-3, (key, error)


def test_the_schedule_is_mindspeeds_hunyuanvideo_15_scheduler() -> None:
    """``hunyuan15_draw`` equals the re-telling of ``q_sample`` (hunyuan_video_15_scheduler.py) draw for draw; the
    target is ``noise - x0``; ``snr: uniform`` draws ``t = r (1 - 2e-5) + 1e-5``; bad keys fail naming them."""
    from lightning_mm.diffusers.hunyuan15_flow import Hunyuan15FlowSchedule, hunyuan15_draw
    from lightning_mm.errors import ConfigError

    schedule = Hunyuan15FlowSchedule()
    latents = torch.randn(3, 4, 2, 4, 4)
    for seed in range(5):
        flow = hunyuan15_draw(schedule, latents, torch.Generator().manual_seed(seed))
        noisy, timesteps, noise = hy._reference_draw(latents, torch.Generator().manual_seed(seed))
        assert torch.allclose(flow.timestep, timesteps, rtol=1e-6)
        assert torch.allclose(flow.noisy, noisy, rtol=1e-5, atol=1e-6)
        assert torch.allclose(flow.target, noise - latents)
        assert ((flow.timestep > 0) & (flow.timestep < 1000)).all()
    generator = torch.Generator().manual_seed(3)
    r = torch.rand((4,), generator=torch.Generator().manual_seed(3))
    uniform = Hunyuan15FlowSchedule(snr="uniform", train_timestep_shift=1.0).timesteps(4, generator)
    assert torch.allclose(uniform, (r * (1 - 2e-5) + 1e-5) * 1000)
    for bad in ({"snr": "mix"}, {"train_timestep_shift": 0}, {"num_train_timesteps": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            Hunyuan15FlowSchedule(**bad)  # type: ignore[arg-type]


def test_features_in_mindspeeds_two_encoder_layout(work: Path, tmp_path: Path) -> None:
    """A feature file whose ``prompt_ids`` / ``prompt_mask`` are lists (MLLM, byT5), each ``(1, L, ...)``, as
    MindSpeed MM's ``get_sora_feature.py`` saves two text encoders' outputs, gives the module's batch keys; another
    list shape fails naming the file."""
    from lightning_mm.data.record_files import DataError
    from lightning_mm.mindspeed.feature_data import WanFeatureDataset, collate_features

    dataset = WanFeatureDataset([work / "features_t2v" / "1.pt", work / "features_t2v" / "3.pt"])
    batch = collate_features([dataset.sample(0), dataset.sample(1)])
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "latents": (2, *hy.LATENT_SHAPE),
        "prompt_embeds": (2, hy.TEXT_LEN, 16),
        "prompt_mask": (2, hy.TEXT_LEN),
        "prompt_embeds_2": (2, hy.GLYPH_LEN, 8),
        "prompt_mask_2": (2, hy.GLYPH_LEN),
    }
    raw = torch.load(work / "features_t2v" / "1.pt", weights_only=True)
    assert torch.equal(batch["prompt_embeds_2"][0], raw["prompt_ids"][1][0])
    i2v = WanFeatureDataset([work / "features_i2v" / "0.pt"]).sample(0)
    assert {k: tuple(v.shape) for k, v in i2v.items() if k in ("condition_latents", "image_embeds")} == {
        "condition_latents": (5, *hy.LATENT_SHAPE[1:]),
        "image_embeds": (hy.IMAGE_TOKENS, 8),
    }
    bad = tmp_path / "bad.pt"
    torch.save({**raw, "prompt_ids": [raw["prompt_ids"][0][0]]}, bad)
    with pytest.raises(DataError, match="bad.pt.*two text encoders"):
        WanFeatureDataset([bad]).sample(0)


def test_mindspeeds_fsdp2_yaml_as_written() -> None:
    from lightning_mm.diffusers.hunyuan15_diffusion import mindspeed_hunyuan15_fsdp2_config

    config = mindspeed_hunyuan15_fsdp2_config(HY / "fsdp2_config.yaml")
    assert config["sub_modules_to_wrap"] == ["predictor.transformer_blocks.{*}"]
    assert config["recompute_modules"] == ["predictor.transformer_blocks.{*}"]
    assert config["ignored_modules"] == []  # ae, text_encoder: features are precomputed


def test_the_module_checks_its_batches_and_its_schedule(work: Path) -> None:
    from lightning_mm.errors import ConfigError, DataError, InputKeyError
    from lightning_mm.modules.hunyuan15_module import MMHunyuan15Module

    model = {"init_from_path": str(work / "model")}
    with pytest.raises(ConfigError, match="schedule.shift"):
        MMHunyuan15Module(model, schedule={"shift": 3.0})
    with pytest.raises(ConfigError, match="only 'hunyuanvideo_15_diffusion'"):
        MMHunyuan15Module(model, schedule={"model_id": "wan_flow_match_scheduler"})
    module = MMHunyuan15Module(model)
    batch = {
        "latents": torch.zeros(1, 4, 2, 4, 4),
        "prompt_embeds": torch.zeros(1, 6, 16),
        "prompt_mask": torch.ones(1, 6),
        "prompt_embeds_2": torch.zeros(1, 5, 8),
        "prompt_mask_2": torch.ones(1, 5),
    }
    with pytest.raises(InputKeyError, match=r"missing \['prompt_mask_2'\].*unknown \['video'\]"):
        module.get_batch({**{k: v for k, v in batch.items() if k != "prompt_mask_2"}, "video": None})
    with pytest.raises(DataError, match="`prompt_embeds_2` must be"):
        module.get_batch({**batch, "prompt_mask_2": torch.ones(1, 4)})
    with pytest.raises(InputKeyError, match=r"missing \['image_embeds'\]"):
        module.get_batch({**batch, "condition_latents": torch.zeros(1, 5, 2, 4, 4)})
    with pytest.raises(DataError, match="`condition_latents` must be"):
        module.get_batch(
            {**batch, "condition_latents": torch.zeros(1, 4, 2, 4, 4), "image_embeds": torch.zeros(1, 3, 8)}
        )
    inputs = module.get_batch(batch)
    assert inputs["hidden_states"].shape == batch["latents"].shape and inputs["timestep"].shape == (1,)


def test_the_model_jsons_migrate_naming_every_key(tree: Path) -> None:
    import inspect

    from lightning_mm.commands.migrate import migrate_file
    from lightning_mm.mindspeed.refusals import Refused
    from lightning_mm.modules.hunyuan15_module import MMHunyuan15Module

    result = migrate_file(tree / "examples/hunyuanvideo_1.5/t2v/model_hunyuanvideo_15.json", base_dir=tree)[0]
    model = result.config["model"]
    assert model["class_path"] == "lightning_mm.modules.hunyuan15_module.MMHunyuan15Module"
    args = model["init_args"]
    assert set(args) <= set(inspect.signature(MMHunyuan15Module.__init__).parameters)
    assert args["schedule"] == {"num_train_timesteps": 1000, "snr": "lognorm", "train_timestep_shift": 3.0}
    report = result.report()
    assert "text_encoder[1].byt5_max_length" in report and "load_text_features: false" in report
    assert "predictor.vision_projection linear-none: as diffusers'" in report
    i2v = migrate_file(tree / "examples/hunyuanvideo_1.5/i2v/model_hunyuanvideo_15.json", base_dir=tree)[0]
    assert i2v.config["model"] == model
    report = i2v.report()
    assert "ae.i2v_processor.processor_path" in report and "predictor.task_type i2v: as diffusers'" in report
    assert "NOT mapped 3 item(s)" in report  # no weights directory; load_video_features / load_text_features: false
    with pytest.raises(Refused, match="template"):
        migrate_file(tree / "examples/hunyuanvideo_1.5/template.json", base_dir=tree)
