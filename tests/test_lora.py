"""LoRA fine-tuning with PEFT: settings checked before training, and 2-rank training against a PEFT reference.

The 2-rank checks run in one launch of tests/scenarios/lora_scenarios.py (see ``all_runs``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.scenario_kit import read_results, run, scenario_env
from tests.scenarios import lora_scenarios
from tests.scenarios.hf_scenarios import save_tiny_checkpoints

ROOT = Path(__file__).resolve().parents[1]
LORA = {"rank": 4, "alpha": 8, "target_modules": ["model.layers.{*}.self_attn.q_proj"]}


def _env() -> dict[str, str]:
    return scenario_env()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora_ckpts")
    return save_tiny_checkpoints(directory, ["qwen3", "qwen2", "qwen2_5_vl", "llama_tied"])


@pytest.fixture(scope="module")
def ranks(ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_out")
    run(lora_scenarios.all_runs, out, args={"ckptdir": ckpts["qwen3"].parent}, timeout=600)
    families = ("qwen3", "qwen2_5_vl", "custom", "mixed")
    return {f: read_results(out, f) for f in families}


# ------------------------------------------------------------------------------------------ 2 ranks
@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl"])
def test_per_step_losses_equal_a_one_process_peft_reference(ranks, family):
    for obs in ranks[family]:
        assert len(obs["losses"]) == 4
        assert obs["losses"] == pytest.approx(obs["ref_losses"], rel=1e-5)
        assert obs["initial_not_peft"] == [], "initial adapters differ from PEFT's for the same seed"
        assert obs["base_not_loaded"] == []
        assert obs["ref_logits_rel"] < 1e-3  # the trained models agree
    assert ranks[family][0]["losses"] != ranks[family][1]["losses"], "ranks should see distinct batches"


@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl"])
def test_only_adapters_train_and_the_optimizer_holds_only_them(ranks, family):
    for obs in ranks[family]:
        assert obs["adapters"] and all(".lora_A." in n or ".lora_B." in n for n in obs["adapters"])
        assert obs["trainable"] == sorted(obs["adapters"])
        assert obs["changed"] and set(obs["changed"]) <= set(obs["adapters"])
        assert any(".lora_B." in n for n in obs["changed"])  # B starts at zero and must move
        assert obs["optimizer_params"] == obs["adapter_numel"]
        assert obs["optimizer_state"] == 2 * obs["adapter_numel"]  # AdamW's two moments, adapters only


def test_frozen_vision_tower_combines_with_lora_on_the_language_model(ranks):
    for obs in ranks["qwen2_5_vl"]:
        assert obs["plan_ignored"] == ["model.visual"]
        assert all(n.startswith("model.language_model.") for n in obs["adapters"])
        assert "trainable" in obs["plan"] and "frozen" in obs["plan"]


@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl"])
def test_exports_give_the_trained_models_logits(ranks, family):
    obs = ranks[family][0]
    assert obs["peft_logits_rel"] < 1e-6  # PeftModel.from_pretrained(base, exported adapters)
    assert obs["merged_logits_rel"] < 1e-5  # Transformers alone, adapters merged
    assert obs["merged_has_lora_keys"] is False


def test_resume_is_exact_and_pretrained_adapters_start_a_sharded_run(ranks):
    for obs in ranks["qwen3"]:
        assert obs["resumed_indices"] == obs["indices"][2:]
        assert obs["resumed_losses"] == obs["losses"][2:]
        assert obs["pretrained_not_equal"] == []  # pretrained_lora_path on a sharded model built on meta
        # Resuming the same checkpoint with another alpha fails on every rank, before any step.
        assert (
            "step=2.ckpt: the checkpoint's LoRA adapters of `model` were trained with alpha 8, the model now "
            "has alpha 16" in obs["changed_alpha_error"]
        )


@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl"])
def test_dcp_to_hf_merge_lora_gives_the_trained_models_logits(ranks, family):
    obs = ranks[family][0]
    assert obs["converted_logits_rel"] < 1e-5
    # Without --merge-lora the adapters' keys would make a directory Transformers cannot load: refused.
    assert obs["convert_unmerged_rc"] == 1 and obs["unmerged_written"] is False


def test_a_custom_model_with_apply_lora_trains_like_peft(ranks):
    for obs in ranks["custom"]:
        assert obs["initial_not_peft"] == []
        assert obs["losses"] == pytest.approx(obs["ref_losses"], rel=1e-5)
        # blocks.{*}.fc1 and everything linear in blocks.1: three targets, A and B each
        assert len(obs["adapters"]) == 6 and set(obs["changed"]) == set(obs["adapters"])


def test_mixed_precision_trains_the_adapters_in_full_precision(ranks):
    for fp32, mixed in zip(ranks["qwen3"], ranks["mixed"]):
        assert mixed["indices"] == fp32["indices"]
        assert mixed["losses"] == pytest.approx(fp32["losses"], rel=2e-2)  # bf16 compute
        assert mixed["adapter_dtypes"] == ["torch.float32"]
        assert set(mixed["changed"]) == set(mixed["trainable"])
        assert "precision: param bfloat16" in mixed["plan"]


def test_a_meta_built_model_without_fsdp2_mixin_is_refused():
    from lightning_mm.core.init_context import meta_parameters
    from lightning_mm.hf.lora import LoRAConfigError, apply_lora

    with meta_parameters():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(LoRAConfigError, match="declare it with lightning_mm.modules.FSDP2Mixin"):
        apply_lora(model, {"target_modules": ["0"]})


# ------------------------------------------------------------------------------- before training
def _build(ckpts, family="qwen3", **lora):
    from lightning_mm.modules import TransformersModel

    return TransformersModel({"init_from_hf_path": str(ckpts[family]), "lora": {**LORA, **lora}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rank": 0}, "`rank`: expected a positive integer, got 0"),
        ({"rank": -2}, "`rank`: expected a positive integer, got -2"),
        ({"alpha": 0}, "`alpha`"),
        ({"dropout": 1.5}, "`dropout`"),
        ({"init_lora_weights": "pissa"}, "`init_lora_weights`"),
        ({"target_modules": []}, "`target_modules`"),
        ({"rnak": 4}, "did you mean `rank`"),
    ],
)
def test_bad_settings_fail_naming_the_key(ckpts, change, message):
    from lightning_mm.hf.lora import LoRAConfigError

    with pytest.raises(LoRAConfigError, match=message.replace("(", r"\(").replace("`", ".")):
        _build(ckpts, **change)


def test_a_target_pattern_that_matches_nothing_is_an_error_naming_it(ckpts):
    from lightning_mm.hf.lora import LoRAConfigError

    with pytest.raises(LoRAConfigError, match=r"lora.target_modules.*model\.layers\.\{\*\}\.self_attn\.qproj"):
        _build(ckpts, target_modules=["model.layers.{*}.self_attn.qproj"])
    with pytest.raises(LoRAConfigError, match="is not an nn.Linear and holds none"):
        _build(ckpts, target_modules=["model.norm"])


def test_adapters_of_another_base_model_fail_before_training(ckpts, tmp_path):
    from lightning_mm.hf.lora import LoRAConfigError
    from lightning_mm.hf.lora_export import save_lora_adapters

    mlp = {"target_modules": ["model.layers.{*}.mlp.down_proj"]}
    save_lora_adapters(_build(ckpts, "qwen2", **mlp), tmp_path / "qwen2")  # 63 MLP rows, Qwen3 has 64
    with pytest.raises(LoRAConfigError, match="pretrained_lora_path.*trained on another base model"):
        _build(ckpts, "qwen3", pretrained_lora_path=str(tmp_path / "qwen2"), **mlp)
    save_lora_adapters(_build(ckpts, "qwen3", **mlp), tmp_path / "qwen3")
    with pytest.raises(LoRAConfigError, match="pretrained_lora_path.*adapt modules"):
        _build(
            ckpts,
            "qwen3",
            pretrained_lora_path=str(tmp_path / "qwen3"),
            target_modules=["model.layers.{0}.mlp.down_proj"],
        )
    with pytest.raises(LoRAConfigError, match="pretrained_lora_path.*no adapter_config.json"):
        _build(ckpts, "qwen3", pretrained_lora_path=str(tmp_path))


def test_pretrained_adapters_are_the_starting_point(ckpts, tmp_path):
    from lightning_mm.hf.lora_export import save_lora_adapters

    first = _build(ckpts)
    with torch.no_grad():
        for p in first.parameters():
            if p.requires_grad:
                p.add_(1.0)
    save_lora_adapters(first, tmp_path / "a")
    second = _build(ckpts, pretrained_lora_path=str(tmp_path / "a"))
    a, b = dict(first.named_parameters()), dict(second.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_adapters_under_a_frozen_module_are_an_error(ckpts):
    from lightning_mm.hf.lora import LoRAConfigError
    from lightning_mm.modules import TransformersModel

    with pytest.raises(LoRAConfigError, match="lies under 'model.layers.0', which `freeze` freezes"):
        TransformersModel({"init_from_hf_path": str(ckpts["qwen3"]), "freeze": ["model.layers.0"], "lora": LORA})


def test_plan_and_memory_show_trainable_and_frozen_parameters(ckpts):
    from lightning_mm.core.config import FSDP2Config
    from lightning_mm.core.init_context import meta_parameters
    from lightning_mm.core.memory import per_rank_memory
    from lightning_mm.core.sharding_plan import build_plan
    from lightning_mm.modules import TransformersModel

    def plan_of(lora):
        extra = {"lora": lora} if lora else {}
        with meta_parameters():
            model = TransformersModel({"init_from_hf_path": str(ckpts["qwen3"]), **extra})
        config = FSDP2Config(sharding_size="auto").with_model_defaults(model)
        plan = build_plan(config, model, 2)
        return plan, per_rank_memory(model, plan)

    lora_plan, lora_mem = plan_of(LORA)
    full_plan, full_mem = plan_of(None)
    text = lora_plan.describe()
    assert "model.layers.0" in text and "trainable" in text and "frozen" in text
    adapter = 2 * (4 * 32 + 32 * 4)  # two layers, A (4 x 32) and B (32 x 4) on q_proj
    assert lora_mem.ddp_grads == 4 * adapter and lora_mem.grads == 4 * adapter // 2
    assert lora_mem.optimizer == 2 * lora_mem.grads
    assert full_mem.grads > 20 * lora_mem.grads
    assert lora_mem.params > full_mem.params  # the adapters themselves


def test_peft_is_not_imported_with_the_package():
    code = "import sys, lightning_mm, lightning_mm.modules; print('peft' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_exports_of_an_adapted_tied_output_layer(ckpts, tmp_path):
    """LoRA on a tied lm_head (one process): PEFT and Transformers reload the trained logits; the model's own
    config is left as it was (PEFT unties the merged copy)."""
    import transformers
    from peft import PeftModel

    from lightning_mm.hf.lora_export import save_lora_adapters, save_merged_model
    from tests.scenarios.hf_scenarios import FamilyData, model_inputs

    model = _build(ckpts, "llama_tied", target_modules=["lm_head", "model.layers.{0}.mlp"])
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    batch = model_inputs(torch.utils.data.default_collate([FamilyData("llama_tied")[i] for i in range(2)]))
    with torch.no_grad():
        logits = model(**batch).logits
        save_lora_adapters(model, tmp_path / "adapters")
        save_merged_model(model, tmp_path / "merged")
        cls = transformers.LlamaForCausalLM
        peft = PeftModel.from_pretrained(cls.from_pretrained(str(ckpts["llama_tied"])), str(tmp_path / "adapters"))
        merged = cls.from_pretrained(str(tmp_path / "merged"))
        assert torch.allclose(peft.eval()(**batch).logits, logits, rtol=0, atol=1e-6)
        assert torch.allclose(merged.eval()(**batch).logits, logits, rtol=0, atol=1e-5)
    assert model.config.tie_word_embeddings is True


def test_initial_adapters_equal_peft_whatever_the_order_of_the_patterns(ckpts):
    import transformers
    from peft import LoraConfig, get_peft_model

    model = _build(ckpts, target_modules=["model.layers.{*}.mlp", "model.layers.{1,0}.self_attn.q_proj"])
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    targets = sorted({n.split(".lora_")[0] for n in adapters})
    reference = transformers.Qwen3ForCausalLM.from_pretrained(str(ckpts["qwen3"]))
    torch.manual_seed(0)
    reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    expected = {n.removeprefix("base_model.model."): p for n, p in reference.named_parameters() if p.requires_grad}
    assert expected.keys() == adapters.keys()
    assert all(torch.equal(adapters[n], expected[n]) for n in adapters)


# ------------------------------------------------------------------------------------------ resuming
def _save_adapted(ckpts, path, **lora):
    """A consolidated checkpoint of a LightningModule-like root whose ``model`` has adapters (``lora`` changes)."""
    from lightning_mm.checkpoint import collect_records, store
    from tests.test_checkpoint import EXTRA

    root = torch.nn.Module()
    root.model = _build(ckpts, **lora)
    store.save(
        {"epoch": 0, "global_step": 2, "state_dict": root.state_dict()},
        path,
        "torch",
        {**EXTRA, **collect_records(root)},
        None,
    )
    return root


def _load_adapted(ckpts, path, **lora):
    from lightning_mm.checkpoint import store

    root = torch.nn.Module()
    root.model = _build(ckpts, **lora)
    store.load(path, root, [], strict=True, rank=0, world_size=1, fitting=False)
    return root


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"alpha": 16}, r"trained with alpha 8, the model now has alpha 16.*Set lora `alpha` back to 8"),
        ({"rank": 2}, r"trained with rank 4, the model now has rank 2"),
        (
            {"target_modules": ["model.layers.{*}.self_attn.k_proj"]},
            r"trained with target_modules \[\"model.layers.0.self_attn.q_proj\".*now has target_modules "
            r"\[\"model.layers.0.self_attn.k_proj\"",
        ),
    ],
)
def test_resuming_with_changed_adapter_settings_fails_before_any_weight_is_read(
    ckpts, tmp_path, change, message, monkeypatch
):
    from lightning_mm.checkpoint import store
    from lightning_mm.hf.lora import LoRAConfigError

    saved = _save_adapted(ckpts, tmp_path / "a.ckpt")
    monkeypatch.setattr(store, "_load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(
        LoRAConfigError,
        match=rf"{tmp_path / 'a.ckpt'}: the checkpoint's LoRA adapters of "
        rf"`model` were {message}",
    ):
        _load_adapted(ckpts, tmp_path / "a.ckpt", **change)
    monkeypatch.undo()
    # The same settings resume; so does another dropout (it changes training noise, not the function).
    for same in ({}, {"alpha": 8.0}, {"dropout": 0.3}):
        loaded = _load_adapted(ckpts, tmp_path / "a.ckpt", **same)
        assert all(torch.equal(v, saved.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_a_checkpoint_from_before_the_lora_record_is_checked_through_its_hf_record(ckpts, tmp_path):
    from lightning_mm.checkpoint import open_source
    from lightning_mm.hf.lora import LoRAConfigError, check_resumed_lora

    _save_adapted(ckpts, tmp_path / "a.ckpt")
    records = dict(open_source(tmp_path / "a.ckpt").extra)
    assert records["lora"]["model"]["lora_alpha"] == 8 and records["lora"]["model"]["r"] == 4
    del records["lora"]
    root = torch.nn.Module()
    root.model = _build(ckpts, alpha=4)
    with pytest.raises(LoRAConfigError, match="alpha 8, the model now has alpha 4"):
        check_resumed_lora(records, root, "old.ckpt")
