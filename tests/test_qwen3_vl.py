"""Dense Qwen3-VL built in, in one process: registration, default plan, meta-device init, pretrained loading,
and what ``lightning-mm plan`` prints. Its 2-rank training against plain Transformers is in tests/test_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors import safe_open

from lightning_mm.core.apply import materialize_and_init
from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.core.sharding_plan import build_plan
from lightning_mm.modules import FSDP2Mixin, ModelHub, TransformersModel, WeightInitMixin
from tests.helpers.qwen3_vl_family import ARCH, CONFIG, Qwen3VLData, hf_config, save_qwen3_vl
from tests.scenarios.hf_scenarios import model_inputs

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
WRAP = [
    "model.language_model.embed_tokens",
    "lm_head",
    "model.visual.patch_embed",
    "model.visual.pos_embed",
    "model.visual.merger",
    "model.visual.deepstack_merger_list.{*}",
    "model.visual.blocks.{*}",
    "model.language_model.layers.{*}",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl") / "qwen3_vl")


def _meta_model(**config) -> torch.nn.Module:
    with meta_parameters():
        return TransformersModel({"hf_config": {"model_type": "qwen3_vl", **CONFIG}, **config})


def test_registered_by_architecture_and_model_type():
    cls = ModelHub.get(ARCH)
    assert cls.__name__ == "MMQwen3VLForConditionalGeneration" and ModelHub.get("qwen3_vl") is cls
    assert issubclass(cls, transformers.Qwen3VLForConditionalGeneration)
    assert issubclass(cls, FSDP2Mixin) and cls.init_weights is WeightInitMixin.init_weights
    assert ModelHub.resolve(None, hf_config())[1] is cls


def test_default_plan_wraps_tower_parts_and_each_deepstack_merger():
    model = _meta_model()
    assert model.default_fsdp2_config() == {"sub_modules_to_wrap": WRAP}
    plan = build_plan(FSDP2Config(sharding_size="auto").with_model_defaults(model), model, 2)
    units = [u.modules for u in plan.units]
    # Each DeepStack merger is a unit of its own (they run after different vision blocks), so is each block.
    for path in (
        "model.visual.deepstack_merger_list.0",
        "model.visual.deepstack_merger_list.1",
        "model.visual.patch_embed",
        "model.visual.pos_embed",
        "model.visual.merger",
        "model.visual.blocks.0",
        "model.language_model.layers.1",
    ):
        assert (path,) in units
    assert plan.root_params == 32  # the final norm, nothing else
    assert plan.ignored_modules == ()


def test_frozen_tower_is_ignored_with_its_mergers():
    model = _meta_model(freeze=["model.visual"])
    defaults = model.default_fsdp2_config()
    assert defaults == {
        "ignored_modules": ["model.visual"],
        "sub_modules_to_wrap": ["model.language_model.embed_tokens", "lm_head", "model.language_model.layers.{*}"],
    }
    plan = build_plan(FSDP2Config(sharding_size="auto").with_model_defaults(model), model, 2)
    assert plan.ignored_modules == ("model.visual",) and plan.root_params == 32


def test_no_deepstack_mergers_leaves_the_pattern_out():
    config = {**CONFIG, "vision_config": {**CONFIG["vision_config"], "deepstack_visual_indexes": []}}
    with meta_parameters():
        model = TransformersModel({"hf_config": {"model_type": "qwen3_vl", **config}})
    assert "model.visual.deepstack_merger_list.{*}" not in model.default_fsdp2_config()["sub_modules_to_wrap"]


def _init_rule_differences(
    built: dict[str, torch.Tensor], eager: dict[str, torch.Tensor], buffers: set[str]
) -> list[str]:
    """Tensors that differ in their init rule: buffers (rotary tables) and constant parameters (zeros, ones) must
    be equal; random parameters must have the same zero pattern (padding rows) and std within 20% (N(0, 0.02)
    against torch's own kaiming-uniform or N(0, 1) defaults differ by 3x to 50x)."""
    bad = []
    for name, expected in eager.items():
        got = built[name]
        if name in buffers or expected.unique().numel() <= 2:
            ok = torch.equal(got, expected)
        else:
            ok = (
                torch.equal(got == 0, expected == 0)
                and not torch.equal(got, expected)
                and abs(float(got.std()) / float(expected.std()) - 1) < 0.2
                and abs(float(got.mean())) < 0.01
            )
        if not ok:
            bad.append(name)
    return bad


def test_meta_device_init_follows_the_constructor():
    torch.manual_seed(5)
    eager = transformers.Qwen3VLForConditionalGeneration(hf_config())
    model = _meta_model()
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # rotary tables are computed at construction
    torch.manual_seed(5)
    materialized = materialize_and_init(model, model, CPU, CPU)
    assert set(materialized) == {n for n, _ in eager.named_parameters()}
    eager_tensors = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    built = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    buffers = {n for n, _ in eager.named_buffers()}
    assert built.keys() == eager_tensors.keys()
    with torch.no_grad():
        assert _init_rule_differences(built, eager_tensors, buffers) == []
        # What the check catches: torch's constructor defaults instead of the model's own rules.
        wrong = {n: t.clone() for n, t in built.items()}
        wrong["model.visual.pos_embed.weight"] = torch.nn.Embedding(16, 32).weight
        wrong["model.visual.merger.linear_fc1.bias"] = torch.nn.Linear(128, 128).bias
        wrong["model.visual.rotary_pos_emb.inv_freq"] = built["model.visual.rotary_pos_emb.inv_freq"] * 0
        assert set(_init_rule_differences(wrong, eager_tensors, buffers)) == {
            "model.visual.pos_embed.weight",
            "model.visual.rotary_pos_emb.inv_freq",
            "model.visual.merger.linear_fc1.bias",
        }


def test_saved_keys_are_the_model_keys(ckpt):
    """Transformers 5 converts no key of this class: the files hold the in-memory names."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1
    keys = set()
    for name in files:
        with safe_open(str(ckpt / name), "pt") as f:
            keys |= set(f.keys())
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32)
    assert keys == set(model.state_dict())


def test_eager_and_deferred_loads_equal_from_pretrained(ckpt):
    reference = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    expected = reference.state_dict()
    eager = TransformersModel({"init_from_hf_path": str(ckpt)}).eval()
    assert type(eager).__name__ == "MMQwen3VLForConditionalGeneration"
    with meta_parameters():
        deferred = TransformersModel({"init_from_hf_path": str(ckpt)})
    materialize_and_init(deferred, deferred, CPU, CPU)
    deferred.load_after_sharding()  # what the strategy calls once the model is sharded: reads every tensor's region
    batch = model_inputs(torch.utils.data.default_collate([Qwen3VLData()[i] for i in range(2)]))
    with torch.no_grad():
        ref_loss = reference(**batch).loss
        for model in (eager, deferred.eval()):
            state = model.state_dict()
            assert [k for k, v in expected.items() if not torch.equal(v, state[k])] == []
            assert torch.equal(model(**batch).loss, ref_loss)


def test_plan_command_prints_the_default_plan(tmp_path):
    from lightning_mm.commands.plan_command import plan_from_cli_config

    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "mm_fsdp2", "logger": False},
        "model": {
            "class_path": "lightning_mm.MMLightningModule",
            "init_args": {"model_provider": "tests.helpers.qwen3_vl_family.tiny_model_provider"},
        },
        "data": {
            "class_path": "lightning_mm.MMDataModule",
            "init_args": {"train_valid_test_datasets_provider": "tests.helpers.qwen3_vl_family.datasets_provider"},
        },
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    text = plan_from_cli_config(["--config", str(path)], world_size=8)
    for unit in (
        "model.visual.patch_embed",
        "model.visual.pos_embed",
        "model.visual.merger",
        "model.visual.deepstack_merger_list.0",
        "model.visual.deepstack_merger_list.1",
        "model.visual.blocks.1",
        "model.language_model.layers.0",
        "lm_head",
    ):
        assert unit in text, text
