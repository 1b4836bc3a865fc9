"""Transformers integration without processes: ModelHub, TransformersModel's config, strict checkpoint checks,
eager loading, meta-device deferral, default sharding plans. Tiny models are built and saved locally."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.core.sharding_plan import build_plan
from lightning_mm.hf.pending_weights import pending_pretrained
from lightning_mm.hf.pretrained_index import CheckpointError
from lightning_mm.modules import (
    FSDP2Mixin,
    ModelHub,
    ModelHubError,
    TransformersModel,
    TransformersModelConfigError,
    WeightInitMixin,
)
from tests.scenarios.hf_scenarios import FAMILIES, FamilyData, model_inputs, save_tiny_checkpoints

BUILTIN = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "InternVLForConditionalGeneration": "internvl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "LlavaForConditionalGeneration": "llava",
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return save_tiny_checkpoints(tmp_path_factory.mktemp("hf"))


def _batch(family: str) -> dict[str, torch.Tensor]:
    data = FamilyData(family)
    return model_inputs(torch.utils.data.default_collate([data[0], data[1]]))


def _reference(family: str, path: Path) -> nn.Module:
    return getattr(transformers, FAMILIES[family][0]).from_pretrained(str(path), dtype=torch.float32).eval()


# -------------------------------------------------------------------------------------------- ModelHub
def test_builtin_adapters_are_registered_by_architecture_and_model_type():
    for arch, model_type in BUILTIN.items():
        cls = ModelHub.get(arch)
        assert ModelHub.get(model_type) is cls
        assert issubclass(cls, getattr(transformers, arch))
        assert issubclass(cls, FSDP2Mixin) and issubclass(cls, WeightInitMixin)
        # The mixin's init_weights wins over Hugging Face's even though the HF class comes first in the bases.
        assert cls.init_weights is WeightInitMixin.init_weights


def test_modelhub_lookup_order_model_id_then_architecture_then_model_type():
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "llama"}
    assert ModelHub.resolve("qwen3", cfg) == ("qwen3", ModelHub.get("Qwen3ForCausalLM"))
    assert ModelHub.resolve(None, cfg) == ("Qwen2ForCausalLM", ModelHub.get("qwen2"))
    assert ModelHub.resolve(None, {"model_type": "llama"})[0] == "llama"
    assert ModelHub.resolve(None, SimpleNamespace(architectures=None, model_type="llava"))[0] == "llava"


def test_modelhub_unknown_key_lists_what_is_registered():
    with pytest.raises(ModelHubError, match="model_id 'qwen4'.*Did you mean 'qwen3'.*Registered keys:.*llama"):
        ModelHub.get("qwen4")
    with pytest.raises(ModelHubError, match=r"architectures\[0\] 'FooModel' or model_type 'foo'.*internvl"):
        ModelHub.resolve(None, {"architectures": ["FooModel"], "model_type": "foo"})
    with pytest.raises(ModelHubError, match="give `model_id`"):
        ModelHub.resolve(None, {})


def test_modelhub_register_decorator_and_table():
    class Mine(transformers.LlamaForCausalLM, FSDP2Mixin, WeightInitMixin):
        pass

    try:
        assert ModelHub.register("mine_test", "mine_alias")(Mine) is Mine
        assert ModelHub.get("mine_alias") is Mine
        with pytest.raises(ModelHubError, match="already registered.*override=True"):
            ModelHub.register("llama")(Mine)
        ModelHub.MODEL_MAPPINGS["mine_table"] = Mine  # MindSpeed MM's way
        assert ModelHub.resolve("mine_table")[1] is Mine
    finally:
        for key in ("mine_test", "mine_alias", "mine_table"):
            ModelHub.MODEL_MAPPINGS.pop(key, None)
    assert ModelHub.get("llama").__name__ == "MMLlamaForCausalLM"


def test_weight_init_mixin_keeps_a_subclass_own_init_weights():
    class Base(nn.Module, WeightInitMixin):
        pass

    class Custom(Base):
        def init_weights(self) -> None:
            self.called = True

    class Derived(Custom):
        pass

    assert Derived.init_weights is Custom.init_weights
    assert Base.init_weights is WeightInitMixin.init_weights


# ------------------------------------------------------------------------------------------ the config
def test_config_as_dict_namespace_or_object(ckpts):
    path = str(ckpts["qwen2"])
    for config in (
        {"init_from_hf_path": path},
        SimpleNamespace(init_from_hf_path=path, model_id=None),
        argparse.Namespace(init_from_hf_path=path, freeze=[], trust_remote_code=False),
        SimpleNamespace(init_from_hf_path=path, hf_config=SimpleNamespace(rms_norm_eps=1e-5)),
    ):
        model = TransformersModel(config)
        assert type(model).__name__ == "MMQwen2ForCausalLM"
    assert model.config.rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"init_from_hf_pth": "x"},
            "unknown TransformersModel config key `init_from_hf_pth`; did you mean `init_from_",
        ),
        (
            {"trust_remote_code": "yes", "hf_config": {"model_type": "llama"}},
            "`trust_remote_code`: expected true or false",
        ),
        ({"init_from_hf_path": "/does/not/exist"}, "`init_from_hf_path`: '/does/not/exist' is not a directory"),
        ({"freeze": [3], "hf_config": {"model_type": "llama"}}, "`freeze`: expected a list"),
        ({"hf_config": "llama"}, "`hf_config`: expected a mapping"),
        ({}, "give `init_from_hf_path`"),
        ({"hf_config": {"model_type": "lama"}}, "unknown model_type 'lama'; did you mean 'llama'"),
        (
            {"hf_config": {"model_type": "llama", "hiden_size": 8}},
            r"`hf_config.hiden_size`.*did you mean 'hidden_size'",
        ),
    ],
)
def test_bad_config_is_a_clear_error(config, match):
    with pytest.raises((TransformersModelConfigError, ModelHubError), match=match):
        TransformersModel(config)


def test_hf_config_overrides_update_the_directory_config(ckpts):
    path = str(ckpts["internvl"])
    model = TransformersModel(
        {
            "init_from_hf_path": path,
            "hf_config": {"text_config": {"rms_norm_eps": 1e-3}, "attn_implementation": "eager"},
        }
    )
    assert model.config.text_config.rms_norm_eps == 1e-3
    assert model.config.text_config.hidden_size == 32  # the rest of the sub-config is the directory's
    assert model.config._attn_implementation == "eager"
    with pytest.raises(TransformersModelConfigError, match=r"`hf_config.text_config.rms_norm_epsilon`"):
        TransformersModel({"init_from_hf_path": path, "hf_config": {"text_config": {"rms_norm_epsilon": 1e-3}}})


def test_random_init_from_hf_config_alone():
    text = {k: v for k, v in FAMILIES["qwen2"][1].items() if k != "tie_word_embeddings"}
    model = TransformersModel({"hf_config": {"model_type": "qwen2", **text}})
    assert type(model).__name__ == "MMQwen2ForCausalLM" and model.config.hidden_size == 32
    model = TransformersModel({"model_id": "qwen3", "hf_config": {**text, "head_dim": 8}})
    assert type(model).__name__ == "MMQwen3ForCausalLM"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.all(model.model.embed_tokens.weight[0] == 0)  # padding row
    assert torch.all(model.model.norm.weight == 1)


def test_trust_remote_code_is_off_unless_asked(tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    mark = tmp_path / "code_ran"
    repo = tmp_path / "remote"
    repo.mkdir()
    (repo / "configuration_custom.py").write_text(
        "from transformers import PretrainedConfig\n"
        f"open({str(mark)!r}, 'w').write('ran')\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'custom_x'\n"
    )
    (repo / "config.json").write_text(
        json.dumps(
            {
                "model_type": "custom_x",
                "architectures": ["CustomXModel"],
                "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"},
            }
        )
    )
    with pytest.raises(ValueError, match="trust_remote_code"):
        TransformersModel({"init_from_hf_path": str(repo)})
    assert not mark.exists()
    # Asked: the checkpoint's code runs; no adapter is registered for it, which is an error listing the keys.
    with pytest.raises(ModelHubError, match="'CustomXModel' or model_type 'custom_x'.*Registered keys"):
        TransformersModel({"init_from_hf_path": str(repo), "trust_remote_code": True})
    assert mark.exists()


def test_freeze_uses_the_yaml_pattern_syntax(ckpts):
    model = TransformersModel({"init_from_hf_path": str(ckpts["qwen2"]), "freeze": ["model.layers.{0}", "model.norm"]})
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith(("model.layers.0.", "model.norm."))}
    with pytest.raises(TransformersModelConfigError, match="`freeze`.*'model.layers.5'"):
        TransformersModel({"init_from_hf_path": str(ckpts["qwen2"]), "freeze": ["model.layers.{5}"]})


# ----------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("family", list(FAMILIES))
def test_eager_load_equals_from_pretrained(family, ckpts):
    model = TransformersModel({"init_from_hf_path": str(ckpts[family])}).eval()
    reference = _reference(family, ckpts[family])
    ours, ref = model.state_dict(), reference.state_dict()
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ours)
    ref_buffers = dict(reference.named_buffers())
    assert all(torch.equal(b, ref_buffers[n]) for n, b in model.named_buffers())  # rotary tables included
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        assert model(**_batch(family)).loss.item() == reference(**_batch(family)).loss.item()
    if family in ("llama_tied", "internvl"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_eager_load_converts_the_checkpoint_dtype(ckpts, tmp_path):
    reference = _reference("qwen2", ckpts["qwen2"]).to(torch.bfloat16)
    reference.save_pretrained(tmp_path)
    model = TransformersModel({"init_from_hf_path": str(tmp_path)})
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, reference.model.layers[0].mlp.up_proj.weight.float())


def test_meta_build_checks_the_checkpoint_and_defers_loading(ckpts):
    with meta_parameters():
        model = TransformersModel({"init_from_hf_path": str(ckpts["llava"])})
    assert all(p.is_meta for p in model.parameters())
    assert not model.model.language_model.rotary_emb.inv_freq.is_meta  # buffers are real
    plan = pending_pretrained(model).plan
    names = {n for e in plan.entries for n in e.names}
    assert {n for n, _ in model.named_parameters(remove_duplicate=False)} <= names
    assert plan.renamed["language_model.model.embed_tokens.weight"] == "model.language_model.embed_tokens.weight"
    # Without a strategy to shard and load it, the model refuses to run rather than train from empty weights.
    with pytest.raises(RuntimeError, match="never loaded.*load_after_sharding"):
        model(**_batch("llava"))


def _rename_weight(src: Path, dst: Path, old: str, new: str) -> None:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors[new] = tensors.pop(old)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "meta"])
def test_strict_load_fails_on_a_renamed_weight(ckpts, tmp_path, deferred):
    bad = tmp_path / "bad"
    _rename_weight(ckpts["llama_tied"], bad, "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.upproj.weight")
    with pytest.raises(CheckpointError) as err:
        if deferred:
            with meta_parameters():
                TransformersModel({"init_from_hf_path": str(bad)})
        else:
            TransformersModel({"init_from_hf_path": str(bad)})
    message = str(err.value)
    assert "1 model weight(s) missing from the checkpoint: model.layers.1.mlp.up_proj.weight" in message
    assert "1 checkpoint weight(s) the model does not have: model.layers.1.mlp.upproj.weight" in message


def test_strict_load_fails_on_shape_and_missing_files(ckpts, tmp_path):
    with pytest.raises(CheckpointError) as err:
        TransformersModel({"init_from_hf_path": str(ckpts["qwen2"]), "hf_config": {"intermediate_size": 48}})
    assert (
        "6 weight(s) with a different shape: model.layers.0.mlp.down_proj.weight: checkpoint [32, 63], "
        "model [32, 48]" in str(err.value)
    )
    assert "missing" not in str(err.value)
    empty = tmp_path / "bin_only"
    empty.mkdir()
    (empty / "config.json").write_text((ckpts["qwen2"] / "config.json").read_text())
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no model.safetensors.*found pytorch_model.bin; only safetensors"):
        TransformersModel({"init_from_hf_path": str(empty)})


def test_read_region_rows_directly_and_other_regions_through_safetensors(ckpts):
    from lightning_mm.hf.loading import read_region
    from lightning_mm.hf.pretrained_index import SafetensorsIndex

    index = SafetensorsIndex.from_directory(ckpts["qwen2"])
    info = index.tensors["model.layers.0.mlp.up_proj.weight"]
    full = load_file(ckpts["qwen2"] / "model.safetensors")[info.key]
    assert list(full.shape) == [63, 32]
    with open(ckpts["qwen2"] / "model.safetensors", "rb") as f:
        files = {info.file: f}
        rows = torch.empty(31, 32)
        read_region(index.directory, files, info, (32, 0), (31, 32), rows)  # rank 1's uneven shard
        assert torch.equal(rows, full[32:])
        half = torch.empty(31, 32, dtype=torch.bfloat16)  # converted on the way
        read_region(index.directory, files, info, (32, 0), (31, 32), half)
        assert torch.equal(half, full[32:].bfloat16())
        cols = torch.empty(63, 5)  # not whole rows: read through safetensors' slicing
        read_region(index.directory, files, info, (0, 3), (63, 5), cols)
        assert torch.equal(cols, full[:, 3:8])


def test_truncated_checkpoint_is_a_clear_error(ckpts, tmp_path):
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((ckpts["qwen2"] / "config.json").read_text())
    data = (ckpts["qwen2"] / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="data offsets .* do not fit"):
        TransformersModel({"init_from_hf_path": str(bad)})


def test_sharded_safetensors_index_is_read(ckpts):
    assert (ckpts["qwen3"] / "model.safetensors.index.json").is_file()
    with meta_parameters():
        model = TransformersModel({"init_from_hf_path": str(ckpts["qwen3"])})
    assert len(pending_pretrained(model).plan.files) > 1


# ------------------------------------------------------------------------------------ default FSDP2 plans
EXPECTED_WRAP = {
    "llama_tied": ["model.embed_tokens", "lm_head", "model.layers.{*}"],
    "qwen2": ["model.embed_tokens", "lm_head", "model.layers.{*}"],
    "qwen3": ["model.embed_tokens", "lm_head", "model.layers.{*}"],
    "internvl": [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.vision_tower.embeddings",
        "model.multi_modal_projector",
        "model.vision_tower.encoder.layer.{*}",
        "model.language_model.layers.{*}",
    ],
    "qwen2_5_vl": [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.visual.patch_embed",
        "model.visual.merger",
        "model.visual.blocks.{*}",
        "model.language_model.layers.{*}",
    ],
    "llava": [
        "model.language_model.embed_tokens",
        "lm_head",
        "model.vision_tower.embeddings",
        "model.multi_modal_projector",
        "model.vision_tower.encoder.layers.{*}",
        "model.language_model.layers.{*}",
    ],
}
# What the default plan leaves in the root unit: norms only (a few hidden sizes), no projector or patch embedding.
ROOT_PARAMS = {"llama_tied": 32, "qwen2": 32, "qwen3": 32, "internvl": 32, "qwen2_5_vl": 32, "llava": 32 + 2 * 64}
TOWER = {"internvl": "model.vision_tower", "qwen2_5_vl": "model.visual", "llava": "model.vision_tower"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_plan_wraps_blocks_and_embeddings_and_ignores_frozen_towers(family, ckpts):
    with meta_parameters():
        model = TransformersModel({"init_from_hf_path": str(ckpts[family])})
    assert model.default_fsdp2_config() == {"sub_modules_to_wrap": EXPECTED_WRAP[family]}
    plan = build_plan(FSDP2Config(sharding_size="auto").with_model_defaults(model), model, 2)
    assert plan.root_params == ROOT_PARAMS[family]
    tied = family in ("llama_tied", "internvl")
    assert any(len(u.modules) == 2 and "lm_head" in u.modules for u in plan.units) == tied
    layers = [n for n, m in model.named_modules() if type(m).__name__ in model._no_split_modules and n[-1].isdigit()]
    assert set(layers) <= set(plan.unit_modules) and len(layers) == (4 if family in TOWER else 2)  # 2 per stack
    if family in TOWER:
        with meta_parameters():
            frozen = TransformersModel({"init_from_hf_path": str(ckpts[family]), "freeze": [TOWER[family]]})
        defaults = frozen.default_fsdp2_config()
        assert defaults["ignored_modules"] == [TOWER[family]]
        assert not any(p.startswith(TOWER[family]) for p in defaults["sub_modules_to_wrap"])
        plan = build_plan(FSDP2Config(sharding_size="auto").with_model_defaults(frozen), frozen, 2)
        assert plan.ignored_modules == (TOWER[family],)
        # Keys the YAML sets win over the defaults.
        config = FSDP2Config(sharding_size="auto", sub_modules_to_wrap=["model.language_model.layers.{0}"])
        assert config.with_model_defaults(frozen).sub_modules_to_wrap == ["model.language_model.layers.{0}"]
        # ... even when the value equals the default: `ignored_modules: []` shards the frozen tower, blocks and all.
        config = FSDP2Config.from_dict({"sharding_size": "auto", "ignored_modules": []}).with_model_defaults(frozen)
        assert config.ignored_modules == [] and config.sub_modules_to_wrap == EXPECTED_WRAP[family]
        assert build_plan(config, frozen, 2).root_params == ROOT_PARAMS[family]
        # A trainable tower the YAML ignores gets no default units inside it.
        config = FSDP2Config(sharding_size="auto", ignored_modules=[TOWER[family]]).with_model_defaults(model)
        assert not any(p.startswith(TOWER[family]) for p in config.sub_modules_to_wrap)
        assert build_plan(config, model, 2).ignored_modules == (TOWER[family],)


def test_import_lightning_mm_does_not_import_transformers_model_code():
    # Transformers' model code is slow to import and, on Ascend machines, imports torch_npu: built-in adapters
    # are registered on the first ModelHub lookup instead.
    import subprocess
    import sys

    code = (
        "import sys, lightning_mm; from lightning_mm.modules import ModelHub; "
        "before = [m for m in sys.modules if m.startswith('transformers.models.llama')]; "
        "ModelHub.get('llama'); after = [m for m in sys.modules if m.startswith('transformers.models.llama')]; "
        "print(len(before), len(after) > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True"]


def test_user_registration_made_before_the_first_lookup_wins_over_the_builtin():
    import subprocess
    import sys

    code = (
        "from lightning_mm.modules import ModelHub\n"
        "class Mine: pass\n"
        "ModelHub.MODEL_MAPPINGS['llama'] = Mine\n"
        "assert ModelHub.get('llama') is Mine and ModelHub.get('qwen2').__name__ == 'MMQwen2ForCausalLM'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
