"""MindSpeed MM's pattern and plan semantics on its shipped native configs (issue #36, item 4): a ``{*}`` pattern
whose suffix exists in only some layers, experts named in both the FSDP and the EP plan, and ``plan`` that never
reads the data section."""

from __future__ import annotations

from pathlib import Path

import yaml

from lightning_mm.commands import migrate

DATA = Path(__file__).resolve().parent / "data" / "mindspeed_native"
QWEN3_5_122B = "qwen3_5__qwen3_5_122B_config.yaml"


def _migrated(name: str, tmp_path: Path, native: dict | None = None) -> dict:
    source = DATA / name
    if native is not None:
        source = tmp_path / name
        source.write_text(yaml.safe_dump(native, sort_keys=False))
    out = tmp_path / "config.yaml"
    migrate.main([str(source), "-o", str(out), "--base-dir", str(tmp_path), "--force"])
    return yaml.safe_load(out.read_text())


def test_experts_in_both_plans_are_sharded_by_expert_parallelism_as_mindspeed_mm_does(tmp_path):
    """MindSpeed MM (``distributed/torch_parallelize.py``, ``ParallelApplier.apply_ep_modules``): with
    ``expert_parallel_size`` > 1 the ``ep_plan`` modules (``apply_efsdp_modules``, by default ``apply_modules``) are
    expert-sharded, then removed from ``fsdp_plan.apply_modules`` by string; with 1 they stay FSDP units."""
    native = yaml.safe_load((DATA / QWEN3_5_122B).read_text())
    parallel = native["parallel"]

    def mindspeed_fsdp_units(parallel: dict) -> list[str]:  # the re-telling
        apply = list(parallel["fsdp_plan"]["apply_modules"])
        ep_plan = parallel.get("ep_plan") or {}
        efsdp = ep_plan.get("apply_efsdp_modules") or ep_plan.get("apply_modules") or []
        if parallel.get("expert_parallel_size", 1) > 1 and ep_plan.get("apply_modules"):
            apply = [x for x in apply if x not in efsdp]
        return apply

    fsdp2 = _migrated(QWEN3_5_122B, tmp_path)["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    want = [m for m in mindspeed_fsdp_units(parallel) if m != "mtp"]  # mtp: no such module here (a note)
    assert fsdp2["sub_modules_to_wrap"] == want
    assert "model.language_model.layers.{*}.mlp.experts" not in want
    assert fsdp2["moe_modules"] == ["model.language_model.layers.{*}.mlp.experts"]

    parallel["expert_parallel_size"] = 1
    fsdp2 = _migrated(QWEN3_5_122B, tmp_path, native)["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    assert fsdp2["sub_modules_to_wrap"] == [m for m in mindspeed_fsdp_units(parallel) if m != "mtp"]
    assert "model.language_model.layers.{*}.mlp.experts" in fsdp2["sub_modules_to_wrap"]
    assert not fsdp2.get("moe_modules")


def test_shipped_qwen3_5_122b_config_plans_at_its_world_size(tmp_path):
    """The shipped Qwen3.5-122B native config, migrated, passes ``lightning-mm plan --config`` at its launch
    script's world size (16 x 8 = 128), with a tiny Qwen3.5-MoE stand-in of the same module paths: the
    ``linear_attn`` pattern wraps exactly the layers that have one, the experts (in both plans) are expert-parallel,
    and the data section (here with a ``val_dataset_param`` and records that do not exist) is never read. The
    migrated file is planned as written (its ``ckpt_path`` included)."""
    import transformers

    from lightning_mm.commands.plan import main as plan_main
    from tests.tiny_qwen3_5 import tiny_qwen3_5_moe

    model_dir = tiny_qwen3_5_moe(tmp_path / "hf")
    native = yaml.safe_load((DATA / QWEN3_5_122B).read_text())
    native["model"]["model_name_or_path"] = str(model_dir)
    native["training"]["load"] = str(model_dir)
    native["data"]["val_dataset_param"] = native["data"]["dataset_param"]
    config = _migrated(QWEN3_5_122B, tmp_path, native)
    config["ckpt_path"] = None  # a fit config's own key
    config["model"]["init_args"]["transformers_model"]["trust_remote_code"] = False
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(config))

    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert plan_main(["--config", str(tmp_path / "plan.yaml"), "--world-size", "128"]) == 0
    text = text.getvalue()
    assert "world size 128, mesh (shard=128)" in text, text
    assert "expert parallel: mesh (ep_replicate=16 x ep=8)" in text, text
    units = text.split("units (", 1)[1].split("<root>", 1)[0]
    layer_types = transformers.AutoConfig.from_pretrained(model_dir).text_config.layer_types
    linear = [i for i, kind in enumerate(layer_types) if kind == "linear_attention"]
    assert 0 < len(linear) < len(layer_types)
    for i in range(len(layer_types)):
        assert (f"model.language_model.layers.{i}.linear_attn " in units) == (i in linear), (i, units)
        assert f"model.language_model.layers.{i}.mlp.experts" not in units  # sharded by expert parallelism
        assert f"model.language_model.layers.{i} " in units
