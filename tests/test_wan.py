"""Wan 2.x video diffusion transformers through diffusers (issue #30).

The 2-rank run (``tests/scenarios/wan_scenarios.py``: MindSpeed MM's Wan 2.1 FSDP2 YAML with recomputation, a checkpoint
after the first epoch and a resumed second epoch) equals a one-process diffusers ``WanTransformer3DModel`` trained
with the same samples, timesteps and noise, step by step; its checkpoint converts to a directory diffusers'
``from_pretrained`` loads. The rest: the schedule against MindSpeed MM's formulas, meta-device building and strict
loading, MindSpeed MM's YAMLs as written, the feature data, the batch checks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import scenario_kit
from tests.scenarios import wan_scenarios
from tests.scenarios.wan_scenarios import TINY_WAN, YAML, reference_losses, write_workdir

ROOT = Path(__file__).resolve().parents[1]
WAN22_YAML = ROOT / "tests" / "data" / "wan" / "wan2.2_A14B_fsdp2_config.yaml"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("wan_work")
    write_workdir(directory)
    return directory


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, work: Path) -> Path:
    import shutil

    out = tmp_path_factory.mktemp("wan_run")
    tree = tmp_path_factory.mktemp("mindspeed_mm")  # a MindSpeed MM checkout: the corpus' examples/
    shutil.copytree(ROOT / "tests" / "data" / "mindspeed_corpus" / "examples", tree / "examples")
    wan_scenarios.write_migrated(work, tree, out)
    scenario_kit.run(wan_scenarios.fit_resume_cp, out, args={"work": work})
    return out


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


# ------------------------------------------------------------------------------------ the 2-rank run
def test_two_ranks_with_recompute_and_resume_equal_the_diffusers_reference(run: Path, work: Path) -> None:
    ranks = [json.loads((run / f"wan.rank{r}.json").read_text()) for r in range(2)]
    assert [[s for s, _, _ in r["losses"]] for r in ranks] == [[0, 1, 2, 3]] * 2  # steps 2, 3 after the resume
    assert {tokens for r in ranks for _, _, tokens in r["losses"]} == {48}  # all video tokens on each rank
    losses = [(ranks[0]["losses"][s][1] + ranks[1]["losses"][s][1]) / 2 for s in range(4)]
    expected, weights = reference_losses(work, 4)
    assert all(_close(a, b) for a, b in zip(losses, expected)), (losses, expected)
    final = torch.load(run / "final.pt", weights_only=True)
    assert sorted(final) == sorted(weights)
    for name, ref in weights.items():
        assert torch.allclose(final[name], ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item()), name
    # MindSpeed MM's YAML as written: the blocks and the head (diffusers' proj_out) are units, the blocks recomputed
    assert ranks[0]["plan"] == {
        "units": ["predictor.blocks.0", "predictor.blocks.1", "predictor.proj_out"],
        "recompute": ["predictor.blocks.0", "predictor.blocks.1"],
    }


def test_context_parallel_2_equals_the_diffusers_reference(run: Path, work: Path) -> None:
    """Both ranks train one sample a step, each on half of its 48 video tokens (Ulysses over the heads)."""
    ranks = [json.loads((run / f"wan.rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["cp_losses"] == ranks[1]["cp_losses"]  # every rank of the group has the whole sample's loss
    assert [(s, tokens) for s, _, tokens in ranks[0]["cp_losses"]] == [(0, 24), (1, 24), (2, 24)]
    grads: dict[str, torch.Tensor] = {}
    expected, weights = reference_losses(work, 3, data_ranks=1, grads=grads)
    losses = [loss for _, loss, _ in ranks[0]["cp_losses"]]
    assert all(_close(a, b) for a, b in zip(losses, expected)), (losses, expected)
    got = torch.load(run / "cp_grads.pt", weights_only=True)
    # Before Adam, which would hide a scale error. The absolute part is relative to the step's largest gradient, as
    # everywhere in the suite: a key bias's exact gradient is zero (softmax ignores a shift shared by all keys), so
    # its elements are rounding noise (1.2e-4 here, differing in the fifth digit with the summation order).
    scale = max(ref.abs().max().item() for ref in grads.values())
    for name, ref in grads.items():
        assert torch.allclose(got[name], ref, rtol=1e-5, atol=1e-6 * scale), name
    final = torch.load(run / "cp_final.pt", weights_only=True)
    for name, ref in weights.items():
        assert torch.allclose(final[name], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), name


def test_lora_on_two_ranks_equals_a_one_process_peft_reference(run: Path, work: Path) -> None:
    """PEFT adapters on the tiny real WanTransformer3DModel under FSDP2 (2 gloo ranks, MindSpeed MM's YAML) train
    as PEFT's ``inject_adapter_in_model`` on the one-process diffusers model does; only the adapters change."""
    from diffusers import WanTransformer3DModel

    ranks = [json.loads((run / f"wan.rank{r}.json").read_text()) for r in range(2)]
    steps = wan_scenarios.LORA_STEPS
    assert [[s for s, _, _ in r["lora_losses"]] for r in ranks] == [list(range(steps))] * 2
    losses = [(ranks[0]["lora_losses"][s][1] + ranks[1]["lora_losses"][s][1]) / 2 for s in range(steps)]
    grads: dict[str, torch.Tensor] = {}
    expected, weights = reference_losses(work, steps, grads=grads, lora=True)
    assert all(_close(a, b) for a, b in zip(losses, expected)), (losses, expected)
    adapters = sorted(n for n in weights if ".lora_A." in n or ".lora_B." in n)
    assert ranks[0]["lora_trainable"] == adapters and len(adapters) == 2 * 2 * 10  # A, B x 2 blocks x 10 linears
    got = torch.load(run / "lora_grads.pt", weights_only=True)  # before Adam, which would hide a scale error
    assert sorted(got) == sorted(grads) == adapters
    scale = max(ref.abs().max().item() for ref in grads.values())
    assert scale > 0 and all(grads[n].abs().max() > 0 for n in adapters if ".lora_B." in n)
    for name, ref in grads.items():  # A's are zero at the first step (B starts at zero), B's are not
        assert torch.allclose(got[name], ref, rtol=1e-5, atol=1e-6 * scale), name
    final = torch.load(run / "lora_final.pt", weights_only=True)
    assert sorted(final) == sorted(weights)
    # The frozen weights as the reference's (unchanged, below); the adapters after 4 Adam steps per tensor relative
    # to their norm, 1e-3: Adam's first update is lr * g / (|g| + eps), about lr * sign(g), so a gradient element
    # near zero carries its rounding into the update (blocks.1.attn2.to_q's B: 3.6e-4 from the 2-rank reduction's
    # summation order; the one-process reference alone differs by 3e-5 between fp32 and fp64).
    for name, ref in weights.items():
        if name in adapters:
            error = ((final[name] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            assert error <= 1e-3, (name, error)
        else:
            assert torch.equal(final[name], ref), name
    base = WanTransformer3DModel.from_pretrained(work / "model").state_dict()
    for name, value in final.items():
        if name in adapters:
            continue
        key = name.removeprefix("model.predictor.").replace(".base_layer.", ".")
        assert torch.equal(value, base[key]), name  # the frozen weights are unchanged
    assert all(final[n].abs().max() > 0 for n in adapters if ".lora_B." in n)  # B trained from zero


@pytest.mark.parametrize("name", sorted(wan_scenarios.MIGRATED))
def test_migrated_wan_configs_train_like_the_diffusers_reference(run: Path, work: Path, name: str) -> None:
    """The corpus' Wan 2.1 launch scripts, migrated (t2v ``pretrain_fsdp2.sh``: full weights with MindSpeed MM's
    FSDP2 YAML; ``finetune_lora.sh``: ``--lora-r 16 --lora-alpha 16`` on the blocks' attention and feed-forward
    linears; i2v ``pretrain.sh``: the tiny i2v model and MindSpeed MM's i2v features, conditioned as its WanDiT
    does; 14B i2v ``finetune_lora.sh``: LoRA on the i2v model, ``ffn.2 ffn.0 proj_q proj_k proj_v proj_out``, which
    as MindSpeed MM's PEFT suffixes leave the cross-attention's image keys and values ``k_img`` / ``v_img``
    (diffusers' ``attn2.add_k_proj`` / ``add_v_proj``) without adapters; its 8 ranks with context parallelism 1
    need no override beyond the 2 ranks) and run by ``lightning-mm fit --config`` on 2 gloo ranks with the tiny
    model and features: the losses and the first step's gradients equal the one-process diffusers reference
    (PEFT's adapters for LoRA, the script's ``--lora-r`` / ``--lora-alpha``) to relative 1e-5, and LoRA trains
    the adapters only."""
    ranks = [json.loads((run / f"migrated_{name}.rank{r}.json").read_text()) for r in range(2)]
    steps = wan_scenarios.MIGRATED_STEPS
    losses = [(ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 for s in range(steps)]
    grads: dict[str, torch.Tensor] = {}
    lora, i2v = name in ("lora", "i2v_lora"), name in ("i2v", "i2v_lora")
    home = wan_scenarios.migrated_work(work, name)
    order = None
    if i2v:  # the corpus' feature_data.json as written: LengthGroupedSampler, shuffled; the reference follows it
        order = [[wan_scenarios.sample_index(home / "features", r["firsts"][s]) for r in ranks] for s in range(steps)]
        assert len({i for step in order for i in step}) == 2 * steps, order  # each sample once in the epoch
    expected, weights = reference_losses(
        home, steps, grads=grads, lora=lora, lora_shape=_script_lora_shape(name), noise_seed=0, i2v=i2v, order=order
    )
    assert all(_close(a, b) for a, b in zip(losses, expected)), (losses, expected)
    got = torch.load(run / f"migrated_{name}_grads.pt", weights_only=True)
    assert sorted(got) == sorted(grads)
    scale = max(ref.abs().max().item() for ref in grads.values())
    for key, ref in grads.items():  # before Adam, which would hide a scale error
        assert torch.allclose(got[key], ref, rtol=1e-5, atol=1e-6 * scale), key
    adapters = sorted(n for n in weights if ".lora_A." in n or ".lora_B." in n)
    assert ranks[0]["trainable"] == (adapters if lora else sorted(weights))
    assert len(adapters) == (2 * 2 * 10 if lora else 0)  # A, B x 2 blocks x 10 linears
    if i2v:  # the image keys and values exist; no script names them (k_img / v_img): LoRA leaves them frozen
        image_kv = [f"model.predictor.blocks.{b}.attn2.add_{k}_proj." for b in (0, 1) for k in "kv"]
        assert all(f"{m}weight" in weights for m in image_kv)
        assert not lora or not [n for n in ranks[0]["trainable"] if n.startswith(tuple(image_kv))]
    final = torch.load(run / f"migrated_{name}_final.pt", weights_only=True)
    assert sorted(final) == sorted(weights)
    for key, ref in weights.items():  # Adam's sign-like first step: 1e-3 of each tensor's norm (see the LoRA test)
        error = ((final[key] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert error <= 1e-3, (key, error)


def _script_lora_shape(name: str) -> tuple[int, float]:
    """The LoRA rank and alpha the corpus script of the migrated job ``name`` passes (``--lora-r`` /
    ``--lora-alpha``), read from the script itself; (16, 16.0) where it has none (the reference ignores it then)."""
    import re

    text = (ROOT / "tests/data/mindspeed_corpus" / wan_scenarios.MIGRATED[name]).read_text()
    rank, alpha = (re.search(rf"--lora-{flag}\s+(\d+)", text) for flag in ("r", "alpha"))
    return (int(rank.group(1)), float(alpha.group(1))) if rank and alpha else (16, 16.0)


def test_fitting_wan_vace_with_context_parallelism_is_refused(run: Path) -> None:
    """``MMFSDP2Strategy(context_parallel_size=2)`` with the tiny Wan VACE model: ``MMWanModule.configure_model``
    refuses it on every rank, before any step (the control branch's tokens are not split)."""
    errors = [(run / f"vace_cp.rank{r}.txt").read_text() for r in range(2)]
    expected = (
        "ConfigError: MMWanModule: context parallelism is not implemented for Wan VACE (the control branch's tokens "
        "are not split); use context_parallel_size 1"
    )
    assert errors == [expected] * 2, errors


VACE_SCHEDULES = {"vace": {}, "vace_high": {"max_timestep_boundary": 0.358, "min_timestep_boundary": 0.0}}
"""The ``diffusion`` sections of the two VACE model.json files beyond the defaults (read independently here)."""


@pytest.mark.parametrize("name", sorted(wan_scenarios.MIGRATED_VACE))
def test_migrated_vace_configs_train_like_the_diffusers_reference(run: Path, work: Path, name: str) -> None:
    """The corpus' Wan VACE launch scripts (``examples/vace/1.3B/pretrain_fsdp.sh``, and the Wan 2.2 high-noise
    expert's ``A14B_wan2.2/pretrain_fsdp_high.sh`` with its timestep boundaries), migrated and run by
    ``lightning-mm fit --config`` on 2 gloo ranks with a tiny ``WanVACETransformer3DModel`` and VACE features
    (``vace_context``): the losses and the first step's gradients equal a one-process diffusers reference to
    relative 1e-5, and only what MindSpeed MM's ``VACEModel.freeze`` trains (``vace_dit``: diffusers'
    ``vace_patch_embedding`` and ``vace_blocks``) is trainable; the Wan part stays as loaded."""
    ranks = [json.loads((run / f"migrated_{name}.rank{r}.json").read_text()) for r in range(2)]
    steps = wan_scenarios.MIGRATED_STEPS
    losses = [(ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 for s in range(steps)]
    grads: dict[str, torch.Tensor] = {}
    expected, weights, trained = wan_scenarios.vace_reference_losses(
        work,
        steps,
        VACE_SCHEDULES[name],
        betas=(0.9, 0.95),
        eps=1e-5,
        grads=grads,  # the scripts' --adam-*
    )
    assert all(_close(a, b) for a, b in zip(losses, expected)), (losses, expected)
    assert ranks[0]["trainable"] == trained == sorted(grads)
    assert any(".vace_blocks.1." in n for n in trained) and "model.predictor.vace_patch_embedding.weight" in trained
    assert not any(n.startswith(("model.predictor.blocks.", "model.predictor.proj_out")) for n in trained)
    got = torch.load(run / f"migrated_{name}_grads.pt", weights_only=True)
    assert sorted(got) == trained
    scale = max(ref.abs().max().item() for ref in grads.values())
    for key, ref in grads.items():  # before Adam, which would hide a scale error
        assert torch.allclose(got[key], ref, rtol=1e-5, atol=1e-6 * scale), key
    final = torch.load(run / f"migrated_{name}_final.pt", weights_only=True)
    assert sorted(final) == sorted(weights)
    for key, ref in weights.items():
        if key in trained:  # Adam's sign-like first step: 1e-3 of each tensor's norm (see the LoRA test)
            error = ((final[key] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            assert error <= 1e-3, (key, error)
        else:
            assert torch.equal(final[key], ref), key  # frozen: as loaded


def test_the_checkpoint_converts_to_a_directory_diffusers_loads(
    run: Path, work: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    from lightning_mm.commands.convert_command import main as convert
    from lightning_mm.diffusers.wan_export import dcp_to_diffusers

    out = tmp_path / "wan"
    assert convert(["dcp-to-diffusers", str(run / "final.ckpt"), str(out), "--config", str(work / "model")]) == 0
    model = WanTransformer3DModel.from_pretrained(out)
    final = torch.load(run / "final.pt", weights_only=True)
    state = model.state_dict()
    assert sorted(f"model.predictor.{k}" for k in state) == sorted(final)
    assert all(torch.equal(state[k[len("model.predictor.") :]], v) for k, v in final.items())
    with pytest.raises(FileExistsError, match="output exists"):
        dcp_to_diffusers(run / "final.ckpt", out, config=work / "model")
    with pytest.raises(ValueError, match=r"holds LoRA adapters \(40, e\.g\. 'blocks\.0\.attn1\.to_k\.lora_A"):
        dcp_to_diffusers(run / "lora.ckpt", tmp_path / "lora", config=work / "model")
    assert not (tmp_path / "lora").exists()  # refused before anything is written
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)  # a few denoising steps with diffusers alone
    scheduler.set_timesteps(3)
    latents, text = torch.randn(1, 4, 3, 8, 8), torch.randn(1, 5, 16)
    with torch.no_grad():
        for t in scheduler.timesteps:
            latents = scheduler.step(model(latents, t.expand(1), text, return_dict=False)[0], t, latents)[0]
    assert latents.shape == (1, 4, 3, 8, 8) and torch.isfinite(latents).all()


# ------------------------------------------------------------------------------------ the schedule
def test_the_schedule_is_mindspeeds_wan_flow_match_scheduler() -> None:
    from lightning_mm.diffusers.flow_matching import WanFlowMatchSchedule

    s = WanFlowMatchSchedule()  # the Wan recipes: 1000 steps, shift 5, sigma_min 0, extra_one_step
    n, shift = 1000, 5.0
    for i in (0, 1, 500, 999):  # MindSpeed MM's formulas, in float64
        sigma = 1.0 - i / n  # linspace(1, 0, n + 1)[:-1]
        shifted = shift * sigma / (1 + (shift - 1) * sigma)
        assert math.isclose(float(s.sigmas[i]), shifted, rel_tol=1e-6)
        assert math.isclose(float(s.timesteps[i]), shifted * n, rel_tol=1e-6)
    y = [math.exp(-2 * ((float(t) - n / 2) / n) ** 2) for t in s.timesteps]
    low = min(y)
    weights = [(v - low) * n / sum(v - low for v in y) for v in y]
    assert max(abs(a - float(b)) for a, b in zip(weights, s.weights)) < 1e-4
    high = WanFlowMatchSchedule(max_timestep_boundary=0.417)  # Wan 2.2 A14B's high-noise expert
    g = torch.Generator().manual_seed(0)
    assert all(0 <= high.draw_index(g) < 417 for _ in range(50))
    latents, noise = torch.randn(2, 4, 1, 2, 2), torch.randn(2, 4, 1, 2, 2)
    sample = s.sample(latents, noise, 10)
    assert torch.allclose(sample.noisy, (1 - s.sigmas[10]) * latents + s.sigmas[10] * noise)
    assert torch.equal(sample.target, noise - latents) and sample.timestep.tolist() == [float(s.timesteps[10])] * 2
    prediction = torch.randn_like(latents)
    mse = ((prediction - (noise - latents)) ** 2).mean()
    assert torch.allclose(s.loss(prediction, sample), mse * s.weights[10])
    with pytest.raises(ValueError, match="must satisfy 0 <= min < max"):
        WanFlowMatchSchedule(min_timestep_boundary=0.5, max_timestep_boundary=0.4)


# ------------------------------------------------------------------------------------ model building
def test_meta_building_defers_loading_and_loading_is_strict(work: Path) -> None:
    from lightning_mm.core.init_context import meta_parameters
    from lightning_mm.diffusers import DiffusersModel, DiffusersModelConfigError, WanDiffusion
    from lightning_mm.hf.pending_weights import pending_pretrained
    from lightning_mm.hf.pretrained_index import CheckpointError

    with meta_parameters():
        model = DiffusersModel({"init_from_path": str(work / "model")})
    assert all(p.is_meta for p in model.parameters()) and pending_pretrained(model) is not None
    assert not model.rope.freqs_cos.is_meta  # computed buffers stay real
    with pytest.raises(RuntimeError, match="never loaded"):
        model(torch.randn(1, 4, 1, 4, 4), torch.tensor([1.0]), torch.randn(1, 5, 16))
    assert WanDiffusion(model).default_fsdp2_config() == {"sub_modules_to_wrap": ["predictor.blocks.{*}"]}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: blocks\.2"):
        DiffusersModel({"init_from_path": str(work / "model"), "config": {"num_layers": 3}})
    with pytest.raises(CheckpointError, match="different shape"):
        DiffusersModel({"init_from_path": str(work / "model"), "config": {"ffn_dim": 40}})
    with pytest.raises(DiffusersModelConfigError, match="no such argument.*num_layers"):
        DiffusersModel({"init_from_path": str(work / "model"), "config": {"num_layer": 3}})
    with pytest.raises(DiffusersModelConfigError, match="unknown DiffusersModel config key"):
        DiffusersModel({"init_from_hf_path": str(work / "model")})
    fresh = DiffusersModel({"model_id": "WanTransformer3DModel", "config": TINY_WAN})
    assert sum(p.numel() for p in fresh.parameters()) == 19832
    flf2v = {**TINY_WAN, "in_channels": 8, "image_dim": 16, "added_kv_proj_dim": 24, "pos_embed_seq_len": 6}
    with meta_parameters():  # random init after meta-device construction, as the strategy does it
        model = DiffusersModel({"model_id": "wan", "config": flf2v})
    from lightning_mm.core.apply import materialize_and_init

    materialize_and_init(model, model, torch.device("cpu"), torch.device("cpu"))  # every tensor filled, or an error
    table = model.blocks[0].scale_shift_table
    assert all(torch.isfinite(p).all() for p in model.parameters()) and 0.1 < float(table.detach().std()) * 24**0.5 < 2


def test_mindspeed_wan_yamls_as_written(work: Path) -> None:
    from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
    from lightning_mm.core.sharding_plan import build_plan
    from lightning_mm.diffusers import DiffusersModel, WanDiffusion
    from lightning_mm.diffusers.wan_diffusion import mindspeed_fsdp2_config

    target = WanDiffusion(DiffusersModel({"model_id": "wan", "config": TINY_WAN}))
    for yaml in (YAML, WAN22_YAML):
        plan = build_plan(FSDP2Config.from_dict(mindspeed_fsdp2_config(yaml)), target, 8)
        assert [u.modules[0] for u in plan.units] == ["predictor.blocks.0", "predictor.blocks.1", "predictor.proj_out"]
        assert list(plan.recompute_modules) == ["predictor.blocks.0", "predictor.blocks.1"]
        assert plan.precision.param_dtype == torch.bfloat16
    with pytest.raises(FSDP2ConfigError, match="'predictor.head' resolves to no module"):  # unmapped: a clear error
        build_plan(FSDP2Config.from_yaml(YAML), target, 8)


# ------------------------------------------------------------------------------------ data and batches
def test_feature_data_through_the_mindspeed_data_config(work: Path, tmp_path: Path) -> None:
    from lightning_mm.data.data_config import DataConfigError
    from lightning_mm.data.record_files import DataError
    from lightning_mm.datamodules import MMDataModule

    dm = MMDataModule.from_config(work / "data.json", batch_size=2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    first = torch.load(work / "features" / "0.pt", weights_only=True)
    assert sorted(batch) == ["latents", "prompt_embeds", "prompt_mask"]
    assert batch["latents"].shape == (2, 4, 3, 8, 8) and torch.equal(batch["latents"][0], first["video"])
    data = json.loads((work / "data.json").read_text())
    lines = (work / "features" / "data.jsonl").read_text() + json.dumps({"file": "../model/config.json"}) + "\n"
    (tmp_path / "data.jsonl").write_text(lines)
    data["dataset_param"]["basic_parameters"]["data_path"] = str(tmp_path / "data.jsonl")
    data["strict"] = True
    (tmp_path / "data.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"data.jsonl:5: `file` '../model/config.json' resolves outside"):
        MMDataModule.from_config(tmp_path / "data.json").setup("fit")
    data["dataset_param"]["basic_parameters"]["data_pth"] = "x"
    (tmp_path / "data.json").write_text(json.dumps(data))
    with pytest.raises(DataConfigError, match="data_pth"):
        MMDataModule.from_config(tmp_path / "data.json").setup("fit")
    torch.save({"video": torch.zeros(4, 1, 2, 2), "prompt_ids": torch.zeros(2, 16), "extra": 1}, tmp_path / "x.pt")
    from lightning_mm.mindspeed.feature_data import WanFeatureDataset

    with pytest.raises(DataError, match=r"unknown feature key\(s\) \['extra'\]"):
        WanFeatureDataset([tmp_path / "x.pt"], strict=True)[0]


def test_the_module_checks_its_batches_and_its_schedule() -> None:
    from lightning_mm.modules.wan_module import MMWanModule

    module = MMWanModule({"model_id": "wan", "config": TINY_WAN})
    batch = {"latents": torch.randn(1, 4, 1, 4, 4), "prompt_embeds": torch.randn(1, 5, 16)}
    inputs = module.get_batch(batch)
    assert inputs["hidden_states"].shape == batch["latents"].shape and inputs["timestep"].shape == (1,)
    with pytest.raises(KeyError, match=r"unknown \['input_ids'\]"):
        module.get_batch({**batch, "input_ids": torch.zeros(1, 3)})
    with pytest.raises(KeyError, match=r"missing \['prompt_embeds'\]"):
        module.get_batch({"latents": batch["latents"]})
    with pytest.raises(ValueError, match="only 'wan_flow_match_scheduler'"):
        MMWanModule({"model_id": "wan", "config": TINY_WAN}, schedule={"model_id": "ddpm"})
    with pytest.raises(ValueError, match="schedule.shfit.*shift"):
        MMWanModule({"model_id": "wan", "config": TINY_WAN}, schedule={"shfit": 5})


def test_image_to_video_inputs_reach_the_model() -> None:
    """Wan 2.1 i2v: condition latents on the channels, CLIP image embeddings before the 512 text tokens."""
    from lightning_mm.modules.wan_module import MMWanModule

    i2v = {**TINY_WAN, "in_channels": 8, "image_dim": 16, "added_kv_proj_dim": 24}
    torch.manual_seed(0)
    module = MMWanModule({"model_id": "wan", "config": i2v})
    module.configure_model()
    batch = {
        "latents": torch.randn(1, 4, 1, 4, 4),
        "prompt_embeds": torch.randn(1, 512, 16),
        "image_embeds": torch.randn(1, 3, 16),
        "condition_latents": torch.randn(1, 4, 1, 4, 4),
    }
    inputs = module.get_batch(batch)
    loss = module.loss_func(module.forward_step(inputs), inputs)
    loss.backward()
    assert module.model.predictor.condition_embedder.image_embedder.ff.net[0].proj.weight.grad.abs().sum() > 0
    expected = module.model.predictor(
        torch.cat([inputs["hidden_states"], batch["condition_latents"]], 1),
        inputs["timestep"],
        batch["prompt_embeds"],
        batch["image_embeds"],
        return_dict=False,
    )[0]
    assert torch.allclose(loss, module.schedule.loss(expected, inputs["flow"]))


def test_wan_inputs_the_model_cannot_take_are_refused_naming_the_keys() -> None:
    """Image-to-video batches meet the checkpoint's config before diffusers runs them: a batch without image
    embeddings, or with text embeddings not 512 long (diffusers' Wan attention takes the last 512 context positions
    as the text, MindSpeed MM's ``text_len``), trained an i2v model silently on the wrong tokens; image features for a
    text-to-video model, or latent plus condition channels other than ``in_channels``, failed inside diffusers."""
    from lightning_mm.diffusers import DiffusersModel, WanDiffusion
    from lightning_mm.errors import DataError
    from tests.scenarios.wan_scenarios import TINY_WAN_I2V

    torch.manual_seed(0)
    i2v, t2v = (WanDiffusion(DiffusersModel({"model_id": "wan", "config": c})) for c in (TINY_WAN_I2V, TINY_WAN))
    latents, timestep = torch.randn(1, 4, 1, 4, 4), torch.tensor([500.0])
    text, image, condition = torch.randn(1, 512, 16), torch.randn(1, 3, 16), torch.randn(1, 8, 1, 4, 4)
    assert i2v(latents, timestep, text, image, condition).shape == latents.shape
    assert t2v(latents, timestep, torch.randn(1, 7, 16)).shape == latents.shape
    with pytest.raises(DataError, match=r"no `image_embeds`, but the model is image-to-video \(image_dim 16\)"):
        i2v(latents, timestep, text, None, condition)
    with pytest.raises(DataError, match=r"`prompt_embeds` has 300 positions; with `image_embeds` they must be 512"):
        i2v(latents, timestep, text[:, :300], image, condition)
    with pytest.raises(DataError, match=r"`latents` 4 \(no `condition_latents`\) = 4 channels.*in_channels is 12"):
        i2v(latents, timestep, text, image)
    with pytest.raises(DataError, match=r"`latents` 4 \+ `condition_latents` 8 = 12 channels.*in_channels is 4"):
        t2v(latents, timestep, text, image, condition)
    with pytest.raises(DataError, match=r"`image_embeds` .* given, but the model has no image embedder"):
        t2v(latents, timestep, text, image)


def test_migrate_names_the_i2v_split_of_the_text_and_image_tokens() -> None:
    """The corpus' Wan 2.1 i2v model.json: ``clip_token_len`` (where MindSpeed MM's WanDiT splits image from text
    tokens) is named in the report, not left as unknown; an i2v ``text_len`` other than 512, which diffusers' split
    cannot follow, is NOT mapped with the reason."""
    from lightning_mm.mindspeed.diffusion import wan_module_config

    path = ROOT / "tests/data/mindspeed_corpus/examples/wan2.1/1.3b/i2v/pretrain_model.json"
    config = json.loads(path.read_text())
    out = wan_module_config(config, str(path), "weights", "--load")
    assert not out.unmapped, out.unmapped
    assert any(n.startswith("predictor.clip_token_len 257: the image tokens are") for n in out.notes), out.notes
    config["predictor"]["text_len"] = 256
    out = wan_module_config(config, str(path), "weights", "--load")
    assert [u for u in out.unmapped if "text_len" in u] == [
        "predictor.text_len 256: model_type i2v needs text_len 512 here: diffusers' Wan attention takes the last 512 "
        "context positions as the text and those before as the image"
    ]
    config["predictor"]["model_type"] = "t2v"  # a t2v model has no image tokens to split off
    assert not wan_module_config(config, str(path), "weights", "--load").unmapped


def test_diffusers_is_imported_only_when_used() -> None:
    code = (
        "import sys, lightning_mm, lightning_mm.diffusers, lightning_mm.modules.wan_module, "
        "lightning_mm.mindspeed.feature_data\nprint('diffusers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_the_loss_is_logged_per_step_to_a_csv_logger(work: Path, tmp_path: Path) -> None:
    """The Wan path logs as every MMLightningModule does: ``train/loss`` each step into the Trainer's loggers
    (``metrics.csv`` of a CSVLogger), equal to the one-process diffusers reference's loss of that step."""
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.modules.wan_module import MMWanModule
    from tests.scenarios.wan_scenarios import LR, NOISE_SEED

    steps = 3
    module = MMWanModule({"init_from_path": str(work / "model")}, noise_seed=NOISE_SEED, lr=LR, log_grad_norm=False)
    logger = CSVLogger(tmp_path, name="wan", version=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=MMDataModule.from_config(work / "data.json", batch_size=1))
    with open(tmp_path / "wan" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == list(range(steps))
    assert all(r["train/lr"] for r in rows)
    expected, _ = reference_losses(work, steps, data_ranks=1)
    for row, loss in zip(rows, expected, strict=True):
        assert _close(float(row["train/loss"]), loss), (row["train/loss"], loss)


def test_the_wan_example_logs_like_the_others(tmp_path: Path) -> None:
    """The example's Trainer writes Lightning's CSV log every step and shows ``lightning-mm fit``'s bar ("Epoch 0 ·
    step 0/3"; Lightning's Rich bar read "Epoch 3/-2" under ``max_steps``)."""
    from lightning.pytorch.loggers import CSVLogger

    from examples.wan.train import make_trainer
    from lightning_mm.commands.progress import MMProgressBar, MMTQDMProgressBar, step_description

    trainer = make_trainer(tmp_path, 3, 1)
    assert isinstance(trainer.logger, CSVLogger) and trainer.log_every_n_steps == 1
    assert isinstance(trainer.progress_bar_callback, (MMProgressBar, MMTQDMProgressBar))
    assert step_description(trainer) == "Epoch 0 · step 0/3"
