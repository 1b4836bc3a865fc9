"""Derived default plans (``lightning_mm.hf.default_plans.derive_fsdp2_plan``) and architectures without an adapter.

* The nine built-in architectures: the derived plan equals the unit list their hand-written adapters gave
  (``tests/derived_plan_expected.json``, computed from the adapters' declarations before they were removed), for
  the adapter class and for the plain Transformers class made FSDP2-ready by ``derived_adapter``.
* Gemma 3, Idefics3, Mistral 3, GLM-4.1V, GLM-4.5V (MoE) and the Qwen2.5-Omni thinker, which have no adapter:
  their derived units, only norms left in the root unit, experts found, frozen towers ignored; their
  ``save_pretrained`` directories (Transformers' original key layout: renamed keys, per-expert tensors fused on
  load; and Transformers 5's own) load strictly into the same weights ``from_pretrained`` gives.
* Models the derivation cannot decide: an error naming the YAML keys.
* Two of them (Idefics3, Mistral 3) trained on 2 ranks with the derived plan against one-process plain
  Transformers per step: plain, reentrant recomputation, frozen tower, and a checkpoint resumed by a new Trainer
  (``tests/scenarios/derive_scenarios.py``, one launch; the parity harness of ``tests/helpers/parity.py``).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import transformers

from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.core.sharding_plan import build_plan
from lightning_mm.hf.default_plans import PlanDerivationError, derive_fsdp2_plan
from lightning_mm.hf.derived_adapters import derived_adapter, is_derived, resolve_model_class
from lightning_mm.hf.model_hub import ModelHub, ModelHubError
from lightning_mm.hf.pending_weights import pending_pretrained
from lightning_mm.hf.plan_source import default_plan_summary
from lightning_mm.modules import TransformersModel
from tests.helpers import derive_models, qwen3_vl_family
from tests.helpers.moe_models import MOE_FAMILIES
from tests.helpers.scenario_kit import run
from tests.scenarios import derive_scenarios
from tests.scenarios.hf_scenarios import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = json.loads((ROOT / "tests" / "derived_plan_expected.json").read_text())
BUILTIN = {**FAMILIES, **MOE_FAMILIES, "qwen3_vl": (qwen3_vl_family.ARCH, qwen3_vl_family.CONFIG)}
TOWERS = {
    "internvl": "model.vision_tower",
    "qwen2_5_vl": "model.visual",
    "llava": "model.vision_tower",
    "qwen3_vl": "model.visual",
    "qwen3_vl_moe": "model.visual",
}


def _plan(model: torch.nn.Module):
    return build_plan(FSDP2Config(sharding_size="auto").with_model_defaults(model), model, 2)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_builtin_architectures_derive_the_plans_their_adapters_declared(case):
    family, frozen = case.removesuffix("-frozen"), case.endswith("-frozen")
    arch, kwargs = BUILTIN[family]
    config = getattr(transformers, arch).config_class(**kwargs)
    config.architectures = [arch]
    adapter = ModelHub.resolve(None, config)[1]
    assert not hasattr(adapter, "fsdp2_vision_towers") and not hasattr(adapter, "fsdp2_extra_units")
    for cls in (adapter, derived_adapter(getattr(transformers, arch))):
        with meta_parameters():
            model = cls(config)
        if frozen:
            model.get_submodule(TOWERS[family]).requires_grad_(False)
        plan = _plan(model)
        expected = EXPECTED[case]
        assert [list(u.modules) for u in plan.units] == expected["units"], cls
        assert list(plan.ignored_modules) == expected["ignored"] and plan.root_params == expected["root_params"]
        assert model.default_fsdp2_config().get("moe_modules", []) == expected["moe_modules"]


# ------------------------------------------------------------------------------- architectures without adapter
NEW_UNITS = {
    "gemma3": [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.vision_tower.embeddings",
        "model.multi_modal_projector",
        "model.vision_tower.encoder.layers.{*}",
        "model.language_model.layers.{*}",
    ],
    "idefics3": [
        "model.text_model.embed_tokens",
        "lm_head",
        "model.vision_model.embeddings",
        "model.connector",
        "model.vision_model.encoder.layers.{*}",
        "model.text_model.layers.{*}",
    ],
    "mistral3": [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.vision_tower.patch_conv",
        "model.multi_modal_projector",
        "model.vision_tower.transformer.layers.{*}",
        "model.language_model.layers.{*}",
    ],
    "glm4v": [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.visual.embeddings",
        "model.visual.patch_embed",
        "model.visual.merger",
        "model.visual.downsample",
        "model.visual.blocks.{*}",
        "model.language_model.layers.{*}",
    ],
    "glm4v_moe": [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.visual.embeddings",
        "model.visual.patch_embed",
        "model.visual.merger",
        "model.visual.downsample",
        "model.visual.blocks.{*}",
        "model.language_model.layers.{*}",
    ],
    "qwen2_5_omni_thinker": [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.audio_tower.conv1",
        "model.audio_tower.conv2",
        "model.audio_tower.audio_bos_eos_token",
        "model.audio_tower.proj",
        "model.visual.patch_embed",
        "model.visual.merger",
        "model.audio_tower.layers.{*}",
        "model.visual.blocks.{*}",
        "model.language_model.layers.{*}",
    ],
}
NEW_TOWERS = {
    "gemma3": ["model.vision_tower"],
    "idefics3": ["model.vision_model"],
    "mistral3": ["model.vision_tower"],
    "glm4v": ["model.visual"],
    "glm4v_moe": ["model.visual"],
    "qwen2_5_omni_thinker": ["model.audio_tower", "model.visual"],
}


def _meta(name: str) -> torch.nn.Module:
    config = derive_models.hf_config(name)
    key, cls, source = resolve_model_class(None, config)
    assert is_derived(cls) and key == config.architectures[0] and "no ModelHub adapter" in source
    with meta_parameters():
        return cls(config)


@pytest.mark.parametrize("name", list(derive_models.ARCHITECTURES))
def test_architectures_without_an_adapter_get_a_derived_plan(name):
    model = _meta(name)
    derived = derive_fsdp2_plan(model)
    assert list(derived.sub_modules_to_wrap) == NEW_UNITS[name]
    assert list(derived.towers) == NEW_TOWERS[name]
    assert list(derived.recompute_candidates) == [p for p in NEW_UNITS[name] if p.endswith(".{*}")]
    plan = _plan(model)
    # Only norms stay in the root unit.
    unit_params = {id(p) for u in plan.units for m in u.modules for p in model.get_submodule(m).parameters()}
    left = {n.rpartition(".")[0] for n, p in model.named_parameters() if id(p) not in unit_params}
    assert left and all(type(model.get_submodule(m)).__name__.endswith("Norm") for m in left), sorted(left)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert any(u.modules == ("model.language_model.embed_tokens", "lm_head") for u in plan.units) == tied
    experts = model.default_fsdp2_config().get("moe_modules", [])
    assert experts == (["model.language_model.layers.1.mlp.experts"] if name == "glm4v_moe" else [])
    # Every frozen tower is ignored, nothing inside it wrapped; recompute candidates stay outside it.
    for tower in NEW_TOWERS[name]:
        model.get_submodule(tower).requires_grad_(False)
    frozen = derive_fsdp2_plan(model)
    assert list(frozen.ignored_modules) == NEW_TOWERS[name]
    assert not any(
        p.startswith(t) for p in frozen.sub_modules_to_wrap + frozen.recompute_candidates for t in NEW_TOWERS[name]
    )
    assert _plan(model).ignored_modules == tuple(NEW_TOWERS[name])


def test_the_plan_summary_says_where_the_default_plan_came_from():
    text = default_plan_summary(_meta("mistral3"))
    assert "derived from MMMistral3ForConditionalGeneration's Transformers metadata (no ModelHub adapter" in text
    assert "recompute candidates (for `recompute_modules`): model.vision_tower.transformer.layers.{*}" in text
    config = transformers.Qwen3Config(**FAMILIES["qwen3"][1])
    with meta_parameters():
        builtin = ModelHub.get("qwen3")(config)
    assert "(adapter lightning_mm.hf.adapters.causal_lm.MMQwen3ForCausalLM)" in default_plan_summary(builtin)
    assert "the YAML sets sub_modules_to_wrap" in default_plan_summary(builtin, ["sub_modules_to_wrap"])


def test_plan_command_prints_the_derived_plan(tmp_path):
    import yaml

    from lightning_mm.commands.plan_command import plan_from_cli_config

    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "mm_fsdp2", "logger": False},
        "model": {
            "class_path": "lightning_mm.MMLightningModule",
            "init_args": {"model_provider": "tests.helpers.derive_models.gemma3_provider"},
        },
        "data": {
            "class_path": "lightning_mm.MMDataModule",
            "init_args": {"train_valid_test_datasets_provider": "tests.helpers.qwen3_vl_family.datasets_provider"},
        },
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    text = plan_from_cli_config(["--config", str(path)], world_size=4)
    assert "model.language_model.embed_tokens + lm_head" in text and "model.multi_modal_projector" in text
    assert "default plan: derived from MMGemma3ForConditionalGeneration's Transformers metadata" in text


def test_derived_classes_pickle_by_reference_and_unknown_classes_are_errors():
    cls = resolve_model_class("Gemma3ForConditionalGeneration")[1]
    assert pickle.loads(pickle.dumps(cls)) is cls and cls.__module__ == "lightning_mm.hf.derived_adapters"
    assert derived_adapter(transformers.Gemma3ForConditionalGeneration) is cls
    with pytest.raises(ModelHubError, match="Or name a Transformers model class"):
        resolve_model_class(None, {"architectures": ["NoSuchForCausalLM"], "model_type": "no_such"})
    with pytest.raises(ModelHubError, match="no model registered in ModelHub for model_id 'os'"):
        resolve_model_class("os")


# ------------------------------------------------------------------------------------------------- errors
def test_models_the_derivation_cannot_decide_are_errors_naming_the_yaml_keys():
    llama = transformers.LlamaConfig(**FAMILIES["llama_tied"][1])
    with meta_parameters():
        no_blocks, unknown = (derived_adapter(transformers.LlamaForCausalLM)(llama) for _ in range(2))
        tower = _meta("idefics3")
    # What each model declares (post_init gathers its sub-models' `_no_split_modules` into the instance's).
    no_blocks._no_split_modules = set()
    unknown._no_split_modules = {"NoSuchDecoderLayer"}
    tower._no_split_modules = {"LlamaDecoderLayer"}  # not Idefics3VisionAttention: no vision block found
    with pytest.raises(
        PlanDerivationError,
        match=r"declares no `_no_split_modules`.*Set `sub_modules_to_wrap`.*"
        r"model\.layers\.\{\*\}",
    ):
        FSDP2Config(sharding_size="auto").with_model_defaults(no_blocks)
    with pytest.raises(PlanDerivationError, match="none of its `_no_split_modules` .NoSuchDecoderLayer."):
        derive_fsdp2_plan(unknown)
    with pytest.raises(
        PlanDerivationError,
        match=r"tower 'model.vision_model' holds no block.*`ignored_modules: "
        r"\[model.vision_model\]`",
    ):
        derive_fsdp2_plan(tower)
    # The YAML's own units: nothing to derive, no error.
    config = FSDP2Config(sharding_size="auto", sub_modules_to_wrap=["model.layers.{*}"]).with_model_defaults(no_blocks)
    assert [u.modules for u in build_plan(config, no_blocks, 2).units] == [("model.layers.0",), ("model.layers.1",)]
    tower.get_submodule("model.vision_model").requires_grad_(False)  # a frozen tower is ignored: decidable
    assert derive_fsdp2_plan(tower).ignored_modules == ("model.vision_model",)


def test_a_class_can_still_declare_its_towers_and_extra_units():
    """What the derivation cannot know: ``fsdp2_vision_towers`` / ``fsdp2_extra_units`` on a registered class."""
    base = transformers.Qwen2_5_VLForConditionalGeneration

    class Declared(base, *derived_adapter(base).__bases__[1:]):
        fsdp2_vision_towers = ("model.visual",)
        fsdp2_extra_units = ("model.visual.merger",)

    arch, kwargs = FAMILIES["qwen2_5_vl"]
    with meta_parameters():
        model = Declared(base.config_class(**kwargs))
    derived = derive_fsdp2_plan(model)
    assert derived.declared == ("fsdp2_vision_towers", "fsdp2_extra_units")
    assert list(derived.sub_modules_to_wrap) == [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.visual.merger",
        "model.visual.blocks.{*}",
        "model.language_model.layers.{*}",
    ]
    assert "fsdp2_extra_units declared by the class" in derived.describe()


# --------------------------------------------------------------------------------------- pretrained loading
@pytest.mark.parametrize("original", [True, False], ids=["original-layout", "transformers5-layout"])
def test_save_pretrained_directories_load_strictly(tmp_path, original):
    """Loaded eagerly and through the meta-device load plan (the sliced path's plan), into from_pretrained's
    weights; a missing tensor is an error."""
    from safetensors.torch import load_file, save_file

    from lightning_mm.hf.pretrained_index import CheckpointError

    dirs = derive_models.save_tiny(tmp_path, list(derive_models.ARCHITECTURES), original_format=original)
    for name, directory in dirs.items():
        ours = TransformersModel({"init_from_hf_path": str(directory)})
        assert is_derived(type(ours))
        ref = getattr(transformers, derive_models.ARCHITECTURES[name][0]).from_pretrained(
            str(directory), dtype=torch.float32
        )
        expected = ref.state_dict()
        got = ours.state_dict()
        assert got.keys() == expected.keys(), name
        assert [k for k in expected if not torch.equal(got[k], expected[k])] == [], name
        with meta_parameters():
            pending = TransformersModel({"init_from_hf_path": str(directory)})
        assert len(pending_pretrained(pending).plan.entries) > 0
    if original:  # per-expert checkpoint tensors (GLM-4.5V's original layout) fused into the 3-D experts
        keys = load_file(dirs["glm4v_moe"] / "model.safetensors")
        assert "model.language_model.layers.1.mlp.experts.3.down_proj.weight" in keys
        del keys["model.language_model.layers.1.mlp.experts.3.down_proj.weight"]
        save_file(keys, dirs["glm4v_moe"] / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match="experts.3.down_proj.weight"):
            TransformersModel({"init_from_hf_path": str(dirs["glm4v_moe"])})


# ---------------------------------------------------------------------------------------------- 2-rank parity
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("derived_parity")
    derive_models.save_tiny(out / "ckpts", [*derive_models.PARITY, *LOAD_ONLY])
    run(derive_scenarios.train, out, timeout=600)
    return out


from tests.scenarios.derive_scenarios import CASES, LOAD_ONLY  # noqa: E402


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_derived_plan_training_matches_plain_transformers(trained, case):
    from tests import test_parity
    from tests.helpers.parity import global_losses, global_steps

    derive_models.register_parity_families()
    ranks = test_parity._ranks(trained, case.name)
    parts = [test_parity._part(ranks, i) for i in range(len(ranks[0]["parts"]))]
    assert len(parts) == (1 if case.resume_at is None else 2)
    if case.resume_at is not None:
        assert len(global_steps(case, parts[0])) == case.resume_at
    part = parts[-1]
    plan = part[0]["plan"]
    assert plan["model_class"] == f"MM{derive_models.ARCHITECTURES[case.family][0]}"
    prefix = "model.vision_model" if case.family == "idefics3" else "model.vision_tower"
    assert any(u[0].startswith(prefix + ".") for u in plan["units"]) != bool(case.freeze)
    assert plan["ignored"] == ([prefix] if case.freeze else [])
    final = torch.load(trained / f"{case.name}.pt", weights_only=True)
    losses = [x for p in parts for x in global_losses(p)]
    steps = [s for p in parts for s in global_steps(case, p)]
    assert len(steps) == case.steps
    test_parity._check(case, losses, final, steps, trained / "ckpts")


@pytest.mark.parametrize("name", list(LOAD_ONLY))
def test_each_rank_reads_its_own_slices_of_a_save_pretrained_directory(trained, name):
    """Original key layout (renamed keys; GLM-4.5V's per-expert tensors fused, and split over 2 EP ranks)."""
    for rank in range(2):
        got = json.loads((trained / f"load-{name}.rank{rank}.json").read_text())
        assert got["wrong"] == [] and got["sharded"] > 0, got
        assert got["model_class"] == f"MM{derive_models.ARCHITECTURES[name][0]}"
        assert (got["split_experts"] > 0) == (name == "glm4v_moe")


def test_the_users_ignored_modules_are_resolved_once_when_planning(monkeypatch):
    # derive_fsdp2_plan leaves the units inside the user's ignored_modules out by reading the patterns; the plan
    # resolves them once (and reports what they miss). Reverting to resolving them in the derivation shows here.
    from lightning_mm.core import patterns

    arch, kwargs = BUILTIN["qwen2_5_vl"]
    config = getattr(transformers, arch).config_class(**kwargs)
    config.architectures = [arch]
    with meta_parameters():
        model = derived_adapter(getattr(transformers, arch))(config)
    ignored = ["model.visual.blocks.{1-1}", "model.visual.merger"]
    calls: list[str] = []
    real = patterns.resolve_pattern

    def counting(root: torch.nn.Module, pattern: str) -> list[str]:
        calls.append(pattern)
        return real(root, pattern)

    monkeypatch.setattr(patterns, "resolve_pattern", counting)
    yaml = FSDP2Config(sharding_size="auto", ignored_modules=ignored).with_model_defaults(model)
    plan = build_plan(yaml, model, 2)
    assert [calls.count(p) for p in ignored] == [1, 1]
    assert plan.ignored_modules == ("model.visual.blocks.1", "model.visual.merger")
    wrapped = {m for u in plan.units for m in u.modules}
    assert "model.visual.blocks.0" in wrapped  # the vision block the user did not ignore is still a unit
    assert not any(m.startswith(("model.visual.blocks.1", "model.visual.merger")) for m in wrapped), wrapped
