"""MindSpeed MM's native FSDP2 route (six-section YAML): migrate with golden reports, the parallel section given to
MMFSDP2Strategy directly, and plans for the shipped configs' world sizes.

The shipped configs are in ``tests/data/mindspeed_native`` (see its README for their source and commit). Golden
files: ``tests/data/mindspeed_native/golden``; regenerate with ``LIGHTNING_MM_REGEN_GOLDEN=1 pytest
tests/test_native_route.py`` and review the diff.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

import pytest
import yaml

from lightning_mm.commands import migrate
from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.mindspeed.keys import MindSpeedConfigError
from lightning_mm.mindspeed.load import fsdp2_config as load_fsdp2_config

DATA = Path(__file__).resolve().parent / "data" / "mindspeed_native"
GOLDEN = DATA / "golden"
CONFIGS = sorted(p.name for p in DATA.glob("*.yaml"))
REGEN = os.environ.get("LIGHTNING_MM_REGEN_GOLDEN") == "1"

# NPUS_PER_NODE x NNODES of each config's launch script in MindSpeed MM (tests/st: the example's)
WORLD_SIZES = {
    "cosyvoice3__cosyvoice3_config.yaml": 8,
    "funasr__funasr_config.yaml": 8,
    "kimi_k3__kimik3_config.yaml": 16,
    "kimik2_5__kimik2_5_config.yaml": 512,
    "ltx2__ltx2_config_t2av.yaml": 8,
    "ltx2__ltx2_config_t2v.yaml": 8,
    "mimov2_5__mimov2_5_config.yaml": 16,
    "moss_tts__moss_tts_delay_config.yaml": 8,
    "qwen3_5__qwen3_5_122B_config.yaml": 128,
    "qwen3_5__qwen3_5_27B_config.yaml": 16,
    "qwen3_5__qwen3_5_35B_config.yaml": 16,
    "qwen3_5__qwen3_5_397B_config.yaml": 256,
    "qwen3_5__qwen3_5_4B_config.yaml": 8,
    "qwen3_5__qwen3_5_9B_config.yaml": 8,
    "qwen3_6__qwen3_6_27B_config.yaml": 16,
    "qwen3_6__qwen3_6_35B_config.yaml": 16,
    "qwen3_asr__qwen3_asr_1.7B_config.yaml": 8,
    "qwen3omni__qwen3omni_config_v1.yaml": 16,
    "qwen3tts__qwen3tts_config.yaml": 8,
    "qwen3vl__qwen3vl_30B_config_v1.yaml": 16,
    "qwen3vl__qwen3vl_30B_config_v1_A5.yaml": 8,
    "step3_vl__step3_vl_10b_config.yaml": 4,
    "st__finetune_kimik2_5__kimik2_5_config.yaml": 512,
    "st__finetune_qwen3_5_35B__qwen3_5_35B_config.yaml": 16,
    "st__finetune_qwen3tts__qwen3tts_config.yaml": 8,
    "st__finetune_qwen3vl_30B__qwen3vl_30B_config_v1.yaml": 16,
}
# Configs of the Qwen3-VL-MoE architecture (an adapter in ModelHub), planned with its tiny stand-in; the dense
# Qwen3.5 / Qwen3.6 ones (a derived Transformers class) are DENSE_QWEN3_5 below.
PLANNED = (
    "qwen3vl__qwen3vl_30B_config_v1.yaml",
    "qwen3vl__qwen3vl_30B_config_v1_A5.yaml",
    "st__finetune_qwen3vl_30B__qwen3vl_30B_config_v1.yaml",
)


def _migrate(name: str, tmp_path: Path, capsys) -> tuple[str, str]:
    """``lightning-mm migrate NAME -o tmp/config.yaml``: (report, written config), paths made stable."""
    out = tmp_path / "config.yaml"
    try:
        # at its launch's world size, so MindSpeed MM's global batch size is recorded (GlobalBatchSize)
        migrate.main(
            [str(DATA / name), "-o", str(out), "--base-dir", str(tmp_path), "--world-size", str(WORLD_SIZES[name])]
        )
        written = out.read_text()
    except MindSpeedConfigError as err:
        written = f"# migrate refused the file: {err}\n"
    report = capsys.readouterr().err

    def stable(text: str) -> str:
        return text.replace(str(tmp_path.resolve()), "<RUN>").replace(str(DATA), "<DATA>")

    return stable(report), stable(written)


def _check_golden(path: Path, text: str) -> None:
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}; run with LIGHTNING_MM_REGEN_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} differs from its golden file (LIGHTNING_MM_REGEN_GOLDEN=1)"


def test_every_shipped_native_config_is_here():
    assert len(CONFIGS) == 26 and set(CONFIGS) == set(WORLD_SIZES)


@pytest.mark.parametrize("name", CONFIGS)
def test_native_config_migrates_with_its_golden_report(name, tmp_path, capsys):
    report, written = _migrate(name, tmp_path, capsys)
    _check_golden(GOLDEN / f"{name[:-5]}.report.txt", report)
    _check_golden(GOLDEN / f"{name[:-5]}.config.yaml", written)
    if written.startswith("# migrate refused"):
        return
    # Every leaf key of parallel / model / features / training / tools is named in the report (mapped, a note,
    # or not mapped), or sits under a key that is.
    data = yaml.safe_load((DATA / name).read_text())
    config = yaml.safe_load(written)
    assert config["trainer"]["strategy"]["class_path"] == "lightning_mm.MMFSDP2Strategy"
    FSDP2Config.from_dict(config["trainer"]["strategy"]["init_args"]["fsdp2_config"])  # a valid 18-key config
    for section in ("parallel", "model", "features", "training", "tools"):
        for leaf in _leaves(data.get(section) or {}, f"{section}."):
            parts = leaf.split(".")
            named = [".".join(parts[:i]) for i in range(len(parts), 1, -1)]
            assert any(_mentions(report, n) for n in named), (name, leaf)


def _leaves(node: dict, prefix: str) -> list[str]:
    out = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def _mentions(report: str, key: str) -> bool:
    return any(
        line.strip().startswith(key) or f" {key}" in line or f"{key} " in line or f"{key}:" in line or f"{key}/" in line
        for line in report.splitlines()
    )


def test_the_report_names_keys_mindspeed_cannot_use_here():
    """Keys that change training and cannot be honoured are NOT mapped, with the reason, never dropped."""
    text = (DATA / "qwen3vl__qwen3vl_30B_config_v1.yaml").read_text()
    data = yaml.safe_load(text)
    data["parallel"].update(ring_attention_size=2, ulysses_parallel_size=2, data_parallel_size=4)
    data["parallel"]["tp_plan"] = {"sequence_parallel": ["model.language_model.norm"]}
    data["features"]["enable_activation_offload"] = True
    from lightning_mm.mindspeed.native_route import migrate_native

    result = migrate_native(DATA / "x.yaml", data)
    unmapped = "\n".join(result.unmapped)
    assert "parallel.tp_plan.sequence_parallel: sequence-parallel regions are not supported" in unmapped
    assert "parallel.ring_attention_size: 2 with ulysses_parallel_size 2: hybrid context parallelism" in unmapped
    assert "parallel.data_parallel_size: 4" in unmapped
    assert "features.enable_activation_offload" in unmapped
    assert result.config["trainer"]["strategy"]["init_args"]["fsdp2_config"]["context_parallel_size"] == 2


def test_lora_packing_async_save_and_hf_format_are_written_under_the_agreed_names(tmp_path):
    """Keys no shipped config turns on, checked as data: the written config uses the option names of the chunked
    loss, packing, async save and the HF checkpoint format."""
    from lightning_mm.mindspeed.native_route import migrate_native

    data = _native("qwen3_5__qwen3_5_4B_config.yaml")
    data["training"].update(
        save_async=True,
        save_format="hf",
        save_ckpt_dtype="bf16",
        lora={"enable": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "dropout": 0.05},
    )
    data["data"]["dataset_param"]["basic_parameters"].update(neat_packing=True, cutoff_len=4096)
    data["parallel"]["ulysses_parallel_size"] = 2
    from lightning_mm.mindspeed.keys import MindSpeedConfigError as MigrateError

    with pytest.raises(MigrateError, match=r"`training.save_format: hf` with `training.lora`: .* use save_format dcp"):
        migrate_native(DATA / "x.yaml", data, base_dir=tmp_path)  # fails before compute, not at the first save
    hf_only = copy.deepcopy(data)
    del hf_only["training"]["lora"]
    hf = migrate_native(DATA / "x.yaml", hf_only, base_dir=tmp_path).config["trainer"]["strategy"]["init_args"]
    assert hf["checkpoint_format"] == "hf"
    hf_only["training"]["save"] = "s3://bucket/run"
    with pytest.raises(MigrateError, match=r"`training.save_format: hf` with `training.save: s3://bucket/run`"):
        migrate_native(DATA / "x.yaml", hf_only, base_dir=tmp_path)
    data["training"]["save_format"] = "dcp"
    remote = copy.deepcopy(data)
    remote["training"]["save"] = "s3://bucket/run"
    callbacks = migrate_native(DATA / "x.yaml", remote, base_dir=tmp_path).config["trainer"]["callbacks"]
    assert callbacks[0]["init_args"]["save_last"] is True  # a link cannot live in an object store
    result = migrate_native(DATA / "x.yaml", data, base_dir=tmp_path)
    config = result.config
    strategy = config["trainer"]["strategy"]["init_args"]
    assert strategy["async_save"] is True and strategy["checkpoint_format"] == "torch_dcp"
    assert strategy["save_ckpt_dtype"] == "bf16" and strategy["fsdp2_config"]["context_parallel_size"] == 2
    model = config["model"]["init_args"]["transformers_model"]
    assert model["lora"] == {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "dropout": 0.05}
    assert model["enable_chunk_loss"] is True and model["chunk_loss_size"] == 1024
    # neat_packing is read by MMDataModule from the data config (packing area); the token budget excludes batch_size
    assert "batch_size" not in config["data"]["init_args"]
    assert any("neat_packing, cutoff_len -> MMDataModule packing" in m for m in result.mapped)
    assert not any(n.startswith("written with options being added") for n in result.notes)  # all exist now
    from lightning_mm.hf.lora import LoRAConfig

    LoRAConfig.from_any(model["lora"])  # a valid lora config here


# ------------------------------------------------------------------------------ the parallel section, directly
def _native(name: str) -> dict:
    return yaml.safe_load((DATA / name).read_text())


def test_parallel_section_and_whole_config_give_the_migrated_fsdp2_config(tmp_path, capsys):
    """MMFSDP2Strategy(fsdp2_config=<parallel section | whole native config | its file>) resolves to the same
    FSDP2Config as the 18-key config migrate writes for it."""
    from lightning_mm import MMFSDP2Strategy

    name = "st__finetune_qwen3vl_30B__qwen3vl_30B_config_v1.yaml"
    _, written = _migrate(name, tmp_path, capsys)
    eighteen = FSDP2Config.from_dict(yaml.safe_load(written)["trainer"]["strategy"]["init_args"]["fsdp2_config"])
    data = _native(name)
    whole = MMFSDP2Strategy(fsdp2_config=data).fsdp2_config
    from_file = MMFSDP2Strategy(fsdp2_config=str(DATA / name)).fsdp2_config
    section = load_fsdp2_config(
        {**data["parallel"], "recompute": True, "recompute_plan": data["features"]["recompute_plan"]}
    )
    assert whole == from_file == section == eighteen
    assert whole.expert_parallel_size == 8 and whole.moe_modules == ["model.language_model.layers.{*}.mlp.experts"]
    assert whole.num_to_backward_prefetch == 0 and whole.use_reentrant is False  # MindSpeed MM's defaults
    assert whole.recompute_modules == ["model.visual.blocks.{*}", "model.language_model.layers.{*}"]


def test_equal_plans_from_the_native_and_the_18_key_forms(tmp_path):
    """Both forms build the same sharding plan on a tiny Qwen3-VL-MoE (the architecture of the config)."""
    from lightning_mm.core.sharding_plan import build_plan
    from tests.helpers.moe_models import tiny_moe_model

    model = tiny_moe_model("qwen3_vl_moe")
    parallel = {**_native("st__finetune_qwen3vl_30B__qwen3vl_30B_config_v1.yaml")["parallel"]}
    parallel["expert_parallel_size"] = 2
    native = load_fsdp2_config(parallel)
    eighteen = load_fsdp2_config(
        {
            "sharding_size": "auto",
            "sub_modules_to_wrap": parallel["fsdp_plan"]["apply_modules"],
            "param_dtype": "bf16",
            "reduce_dtype": "fp32",
            "num_to_backward_prefetch": 0,
            "use_reentrant": False,
            "expert_parallel_size": 2,
            "moe_modules": ["model.language_model.layers.{*}.mlp.experts"],
        }
    )
    assert build_plan(native, model, 4).describe() == build_plan(eighteen, model, 4).describe()


@pytest.mark.parametrize(
    "section, message",
    [
        (
            {"fsdp_plan": {"apply_modul": ["a"]}},
            "unknown native FSDP2 config key `fsdp_plan.apply_modul`; did you mean `fsdp_plan.apply_modules`?",
        ),
        ({"fsdp_plan": {"param_dtype": "bf17"}}, "`fsdp_plan.param_dtype`: unknown dtype 'bf17'"),
        ({"fully_shard_parallel_size": 0}, "`fully_shard_parallel_size`: expected an integer >= 1, got 0"),
        # tensor_parallel_size alone is an FSDP2 config key too (tests/test_layout.py); in a native section it is
        # read as MindSpeed MM's, range-checked under its name.
        (
            {"fully_shard_parallel_size": 1, "tensor_parallel_size": 0},
            "`tensor_parallel_size`: expected an integer >= 1, got 0",
        ),
        (
            {"fully_shard_parallel_size": 1, "tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": ["a.{0-3}"]}},
            "`tp_plan.colwise_parallel`: 'a.{0-3}': only whole-segment `{*}` wildcards",
        ),
        (
            {"fully_shard_parallel_size": 1, "tensor_parallel_size": 2, "tp_plan": {"sequence_parallel": ["norm"]}},
            "tp_plan.sequence_parallel: sequence-parallel regions are not supported here",
        ),
        (
            {"ring_attention_size": 2, "ulysses_parallel_size": 2},
            "ring_attention_size: 2 with ulysses_parallel_size 2: hybrid context parallelism",
        ),
        ({"ulysses_parallel_size": 0}, "`ulysses_parallel_size`: expected an integer >= 1, got 0"),
        ({"recompute": "yes"}, "`recompute`: expected true or false, got 'yes'"),
        ({"ep_plan": {"dispatcher": "nccl"}}, "`ep_plan.dispatcher`: 'nccl' is not a MindSpeed MM dispatcher"),
    ],
)
def test_bad_parallel_sections_are_errors_naming_the_key(section, message):
    with pytest.raises(FSDP2ConfigError) as err:
        load_fsdp2_config(section)
    assert message in str(err.value)


def test_a_whole_native_file_names_the_file_and_section_in_errors(tmp_path):
    path = tmp_path / "native.yaml"
    path.write_text("parallel:\n  fsdp_plan:\n    reshard_after_forwad: true\nmodel: {}\n")
    with pytest.raises(
        FSDP2ConfigError,
        match=r"`parallel\.fsdp_plan\.reshard_after_forwad` in .*native\.yaml; "
        r"did you mean `parallel\.fsdp_plan\.reshard_after_forward`",
    ):
        load_fsdp2_config(str(path))


def test_speed_only_keys_warn_by_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_fsdp2_config({"fsdp_plan": {"pregather": True, "apply_modules": ["layers.{*}"]}})
    assert any("fsdp_plan.pregather" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------ plans for the world sizes
@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "moss_tts__moss_tts_delay_config.yaml"])
def test_every_config_resolves_for_its_world_size(name):
    """From the config alone (the models are too big to build, most have no adapter here): the migrated FSDP2
    config's shard group and expert-parallel size fit the launch script's world size."""
    from lightning_mm.mindspeed.native_route import migrate_native

    result = migrate_native(DATA / name, _native(name))
    config = FSDP2Config.from_dict(result.config["trainer"]["strategy"]["init_args"]["fsdp2_config"])
    world = WORLD_SIZES[name]
    size = _native(name)["parallel"].get("fully_shard_parallel_size", "auto")
    assert config.resolve_sharding_size(world) == (world if size == "auto" else size)  # 1 (FunASR): replicas only
    config.check_expert_parallel_size(world)
    assert config.expert_parallel_size == _native(name)["parallel"].get("expert_parallel_size", 1)


def test_migrating_a_native_config_imports_neither_lightning_nor_transformers():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "lightning_mm.cli",
            "migrate",
            str(DATA / "qwen3vl__qwen3vl_30B_config_v1.yaml"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert not imported & {"lightning", "pytorch_lightning", "transformers"}


@pytest.mark.parametrize("name", PLANNED)
def test_lightning_mm_plan_for_the_configs_world_size(name, tmp_path, capsys):
    """``lightning-mm plan`` of the migrated config at the launch script's world size, on the meta device, with a
    tiny Qwen3-VL-MoE stand-in of the 30B checkpoint (the same module paths)."""
    from lightning_mm.commands.plan_command import plan_from_cli_config
    from tests.helpers.moe_models import tiny_moe_model

    model_dir = tmp_path / "hf"
    tiny_moe_model("qwen3_vl_moe").save_pretrained(model_dir)
    _, written = _migrate(name, tmp_path, capsys)
    config = yaml.safe_load(written.replace("<RUN>", str(tmp_path.resolve())).replace("<DATA>", str(DATA)))
    model = config["model"]["init_args"]["transformers_model"]
    model.update(init_from_hf_path=str(model_dir), trust_remote_code=False)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(config))
    text = plan_from_cli_config(["--config", str(tmp_path / "plan.yaml")], world_size=WORLD_SIZES[name])
    world = WORLD_SIZES[name]
    assert f"world size {world}, mesh (shard={world})" in text, text
    units = text.split("units (", 1)[1].split("<root>", 1)[0]
    for unit in (
        "model.visual.blocks.0",
        "model.visual.deepstack_merger_list.0",
        "model.language_model.layers.1",
        "model.visual.merger",
        "model.language_model.embed_tokens",
        "lm_head",
    ):
        assert unit in units, (unit, text)
    assert "recomputed (non-reentrant): model.visual.blocks.0" in text
    if name.startswith("st__"):  # expert_parallel_size 8 on 16 ranks
        assert "expert parallel: mesh (ep_replicate=2 x ep=8)" in text, text


# ------------------------------------------------------------------------------ training, 2 ranks
TRAINED = "qwen3vl__qwen3vl_30B_config_v1.yaml"  # the MoE VLM; see docs/migration.md for the others
DENSE = "qwen3_5__qwen3_5_4B_config.yaml"  # the dense VLM


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "moss_tts__moss_tts_delay_config.yaml"])
def test_the_report_says_which_configs_cannot_train_here(name, tmp_path):
    """An architecture with an adapter is its ModelHub key; Qwen3.5 / Qwen3.6 (a Transformers class, its plan
    derived) leave model_id out, said in the mapped items; any other is NOT mapped, by name, model_id left out."""
    from lightning_mm.mindspeed.native_route import DERIVED_MODEL_IDS, NATIVE_MODEL_IDS, migrate_native

    data = _native(name)
    result = migrate_native(DATA / name, data, base_dir=tmp_path)
    model_id = data["model"].get("model_id")
    written = result.config["model"]["init_args"]["transformers_model"]
    if model_id in NATIVE_MODEL_IDS:
        assert written["model_id"] == NATIVE_MODEL_IDS[model_id]
    elif model_id in DERIVED_MODEL_IDS:  # a Transformers class, its plan derived (trained: the dense VLM test)
        assert "model_id" not in written
        assert any(
            line.startswith(f"model.model_id {model_id} -> none: ") and DERIVED_MODEL_IDS[model_id] in line
            for line in result.mapped
        ), result.mapped
        from lightning_mm.hf.derived_adapters import transformers_architecture

        assert transformers_architecture(DERIVED_MODEL_IDS[model_id]) is not None
    else:
        assert "model_id" not in written
        assert any(
            line.startswith(f"model.model_id: {model_id}: ") and "does not train here yet" in line
            for line in result.unmapped
        ), result.unmapped


def _tiny_qwen3_vl_moe(directory: Path) -> Path:
    """A tiny Qwen3-VL-MoE directory: the tiny Qwen3-VL's tokenizer, processor and chat template with the MoE
    model of the same dimensions (8 experts, 2 per token) in place of the dense one."""
    import torch
    import transformers

    from lightning_mm.testing.tiny_vlms import write_tiny_vlm

    write_tiny_vlm(directory, "qwen3_vl", seed=3, init_std=0.3, min_pixels=32 * 32, max_pixels=64 * 64)
    dense = transformers.AutoConfig.from_pretrained(directory)
    drop = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")
    text = {k: v for k, v in dense.text_config.to_dict().items() if k not in drop}
    text.update(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    vision = {k: v for k, v in dense.vision_config.to_dict().items() if k not in drop}
    config = transformers.Qwen3VLMoeConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **{
            k: getattr(dense, k)
            for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        },
    )
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    torch.manual_seed(5)
    transformers.Qwen3VLMoeForConditionalGeneration(config).save_pretrained(directory)
    return directory


def _images_and_records(root: Path) -> Path:
    from PIL import Image

    (root / "images").mkdir(parents=True)
    for i, size in enumerate(((32, 32), (32, 64), (64, 32), (32, 32))):
        Image.new("RGB", size, (40 * i + 20, 200 - 30 * i, 90)).save(root / "images" / f"{i}.png")
    answers = [
        "A red square.",
        "Two cats.",
        "The answer is 2.",
        "left",
        "Blue ground.",
        "No, it is not.",
        "top",
        "One dog and two cats.",
    ]
    lines = []
    for i, answer in enumerate(answers):
        image = i % 3 != 1  # some text-only records
        user = ("<image>" if image else "") + "What is in this picture?"
        record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        if image:
            record["images"] = [f"images/{i % 4}.png"]
        lines.append(json.dumps(record))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root / "train.jsonl"


def _tiny_qwen3_5(directory: Path) -> Path:
    """A tiny dense Qwen3.5 directory: the tiny Qwen3-VL's tokenizer, processor and chat template (Qwen3.5 uses
    Transformers' Qwen3VLProcessor and the same chat tokens) with a Qwen3.5 model of the same dimensions: one
    gated-delta-net (linear attention) layer and one full-attention layer, run by Transformers' torch code."""
    import torch
    import transformers

    from lightning_mm.testing.tiny_vlms import write_tiny_vlm

    write_tiny_vlm(directory, "qwen3_vl", seed=3, init_std=0.3, min_pixels=32 * 32, max_pixels=64 * 64)
    dense = transformers.AutoConfig.from_pretrained(directory)
    small = dense.text_config
    text = dict(
        vocab_size=small.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        pad_token_id=small.pad_token_id,
        eos_token_id=small.eos_token_id,
        initializer_range=0.3,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.5,
        },
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=32,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
        initializer_range=0.3,
    )
    config = transformers.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **{
            k: getattr(dense, k)
            for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        },
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(5)
    transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(directory)
    return directory


def _tiny_native_run(native: dict, model_dir: Path, records: Path, tmp_path: Path) -> None:
    """The shipped config pointed at the tiny stand-in and its records, fp32, 2 steps of batch 2, constant lr."""
    native["parallel"]["fsdp_plan"].update(param_dtype="fp32", reduce_dtype="fp32")
    data = native["data"]
    data["dataset_param"]["preprocess_parameters"].update(model_name_or_path=str(model_dir), image_max_pixels=4096)
    data["dataset_param"]["basic_parameters"].update(
        dataset_dir=str(records.parent), dataset=str(records), cache_dir=str(tmp_path / "cache")
    )
    data["dataloader_param"].update(num_workers=0, pin_memory=False)
    native["model"]["model_name_or_path"] = str(model_dir)
    native["model"]["attn_implementation"] = "sdpa"
    native["training"].update(
        micro_batch_size=2, lr=5.0e-3, lr_warmup_ratio=0.0, lr_decay_style="constant", train_iters=2
    )
    native["training"].pop("load", None)
    del native["training"]["save_interval"]


def _fit(native: dict, tmp_path: Path, capsys, also: tuple[tuple[dict, Path], ...] = ()) -> tuple[str, dict]:
    """``lightning-mm migrate`` the native config, then ``lightning-mm fit`` it on 2 CPU ranks: (report, config).
    ``also``: more native configs, each migrated into and recording to its folder, fitted after it in the same
    launch (one model shared by several checks)."""
    from tests.helpers.scenario_kit import run
    from tests.scenarios import native_scenarios

    written = [_migrated(native, tmp_path, capsys)] + [_migrated(n, folder, capsys) for n, folder in also]
    run(native_scenarios.fit_config, tmp_path, args={"config": os.pathsep.join(str(out) for _, _, out in written)})
    return written[0][0], written[0][1]


def _migrated(native: dict, tmp_path: Path, capsys) -> tuple[str, dict, Path]:
    """The config ``lightning-mm migrate`` writes for ``native`` in ``tmp_path``, set up for a 2-rank CPU fit that
    records to ``tmp_path``: (report, config, its file)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "native.yaml"
    source.write_text(yaml.safe_dump(native, sort_keys=False))
    out = tmp_path / "config.yaml"
    migrate.main([str(source), "-o", str(out), "--base-dir", str(tmp_path)])
    report = capsys.readouterr().err
    config = yaml.safe_load(out.read_text())
    config["trainer"].update(
        accelerator="cpu",
        devices=2,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path / "run"),
        callbacks=[{"class_path": "tests.scenarios.native_scenarios.Recorder", "init_args": {"outdir": str(tmp_path)}}],
    )
    config["model"]["init_args"].update(log_grad_norm=False)
    config["model"]["init_args"]["transformers_model"]["trust_remote_code"] = False  # a Transformers class
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return report, config, out


def _assert_equals_plain_transformers(cls: type, model_dir: Path, tmp_path: Path, frozen: str | None) -> list[dict]:
    """Each step's loss on each rank equals one process of plain ``cls`` (same AdamW, fp32, the ranks' batches,
    gradients averaged) to relative 1e-5; returns the ranks' records."""
    import torch

    ranks = [json.loads((tmp_path / f"native.rank{r}.json").read_text()) for r in range(2)]
    batches = [torch.load(tmp_path / f"native.rank{r}.pt", weights_only=True) for r in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = cls.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        if frozen:
            for parameter in model.get_submodule(frozen).parameters():
                parameter.requires_grad_(False)
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8
        )
        expected: list[list[float]] = [[], []]
        for step in range(2):
            optimizer.zero_grad()
            for rank in range(2):
                loss = model(**batches[rank][step]).loss
                (loss / 2).backward()  # the ranks' gradients are averaged
                expected[rank].append(float(loss.detach()))
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        got = torch.tensor(ranks[rank]["losses"], dtype=torch.float64)
        want = torch.tensor(expected[rank], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (rank, got.tolist(), want.tolist())
    assert expected[0][0] != expected[0][1]
    return ranks


def _text_records(root: Path, count: int = 24) -> Path:
    root.mkdir(parents=True)
    words = ["red", "two cats", "the answer is 2", "left", "blue ground", "no, it is not", "top", "one dog"]
    lines = []
    for i in range(count):
        user = f"Question {i}: what is {words[i % 8]}?"
        answer = " ".join(words[(i + k) % 8] for k in range(1 + i % 3)) + "."
        record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        lines.append(json.dumps(record))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root / "train.jsonl"


def _segments(position_ids):  # noqa: ANN001, ANN202 - tensors
    """The (start, stop) of each sample in a packed row: a sample starts where its positions restart at 0."""
    starts = [i for i, p in enumerate(position_ids.tolist()) if p == 0]
    return list(zip(starts, starts[1:] + [len(position_ids)]))


def _packed_reference(model_dir: Path, batches: list[list[dict]]) -> list[list[float]]:
    """Each rank's losses by plain Transformers' Qwen3_5ForConditionalGeneration, one process: every sample of a
    packed row run by itself (no packing), the row's loss the sum of its samples' next-token losses over their
    count; the ranks' gradients averaged, AdamW as migrated."""
    import torch
    import torch.nn.functional as F
    import transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        expected: list[list[float]] = [[], []]
        for step in range(2):
            optimizer.zero_grad()
            for rank in range(2):
                batch = batches[rank][step]
                assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one packed row
                total, count = 0.0, 0
                length = batch["input_ids"].shape[1]
                pieces = _segments(batch["position_ids"].reshape(-1, length)[0])  # text positions (M-RoPE: row 0)
                assert len(pieces) >= 2, pieces  # packed: several samples in the row
                for start, stop in pieces:
                    ids = batch["input_ids"][:, start:stop]
                    labels = batch["labels"][:, start:stop]
                    logits = model(input_ids=ids).logits
                    target = labels[:, 1:]
                    total = total + F.cross_entropy(
                        logits[:, :-1].reshape(-1, logits.shape[-1]),
                        target.reshape(-1),
                        ignore_index=-100,
                        reduction="sum",
                    )
                    count += int((target != -100).sum())
                loss = total / count
                (loss / 2).backward()
                expected[rank].append(float(loss.detach()))
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return expected


def _packed_native(model_dir: Path, folder: Path) -> dict:
    """The dense Qwen3.5 config for a 2-step fit (:func:`_tiny_native_run`) on text records, with MindSpeed MM's
    ``neat_packing`` and ``cutoff_len: 96``."""
    native = _native(DENSE)
    _tiny_native_run(native, model_dir, _text_records(folder / "data"), folder)
    native["features"].update(enable_chunk_loss=False, enable_activation_offload=False)
    native["data"]["dataset_param"]["basic_parameters"].update(neat_packing=True, cutoff_len=96)
    return native


def _assert_packed_equals_plain_transformers(model_dir: Path, folder: Path) -> None:
    """The packed run recorded in ``folder``: no batch_size (a token budget of cutoff_len per row), several samples a
    row, each rank's losses equal to :func:`_packed_reference` to relative 1e-5."""
    import torch

    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert "batch_size" not in config["data"]["init_args"], config["data"]["init_args"]
    ranks = [json.loads((folder / f"native.rank{r}.json").read_text()) for r in range(2)]
    batches = [torch.load(folder / f"native.rank{r}.pt", weights_only=True) for r in range(2)]
    expected = _packed_reference(model_dir, batches)
    for rank in range(2):
        got = torch.tensor(ranks[rank]["losses"], dtype=torch.float64)
        want = torch.tensor(expected[rank], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (rank, got.tolist(), want.tolist())
    assert expected[0][0] != expected[0][1]


def test_migrated_moe_vlm_config_trains_like_plain_transformers(tmp_path, capsys):
    """MindSpeed MM's Qwen3-VL-30B-A3B native config (its FSDP plan, recompute plan, frozen vision tower, loss,
    data section), with expert parallelism 2 switched on, migrated and run by ``lightning-mm fit`` on 2 CPU ranks
    with a tiny Qwen3-VL-MoE stand-in: each step's loss on each rank equals one process of plain Transformers
    (same AdamW, fp32, the same batches) to relative 1e-5."""
    import transformers

    model_dir = _tiny_qwen3_vl_moe(tmp_path / "hf")
    records = _images_and_records(tmp_path / "data")
    native = _native(TRAINED)
    _tiny_native_run(native, model_dir, records, tmp_path)
    native["parallel"]["expert_parallel_size"] = 2
    report, config = _fit(native, tmp_path, capsys)
    assert "parallel.expert_parallel_size -> fsdp2_config.expert_parallel_size: 2" in report
    assert config["model"]["init_args"]["transformers_model"]["freeze"] == ["model.visual"]
    ranks = _assert_equals_plain_transformers(
        transformers.Qwen3VLMoeForConditionalGeneration, model_dir, tmp_path, frozen="model.visual"
    )
    assert ranks[0]["expert_parallel_size"] == 2
    assert ranks[0]["recompute_modules"] == native["features"]["recompute_plan"]["apply_modules"]
    assert "model.visual.deepstack_merger_list.0" in ranks[0]["units"]


def test_migrated_dense_vlm_config_trains_like_plain_transformers(tmp_path, capsys):
    """MindSpeed MM's Qwen3.5-4B native config (its FSDP plan with ``mtp``, recompute plan, template
    ``qwen3_vl_nothink``, data section), migrated and run by ``lightning-mm fit`` on 2 CPU ranks with a tiny dense
    Qwen3.5 stand-in (gated-delta-net and full-attention layers, no ModelHub adapter: the class and its plan are
    derived from config.json's architectures): each step's loss on each rank equals one process of plain
    Transformers' Qwen3_5ForConditionalGeneration (same AdamW, fp32, the same batches) to relative 1e-5.

    In the same launch, the config with MindSpeed MM's ``neat_packing: true`` and ``cutoff_len: 96`` in its data
    section (the corpus' configs leave it off) on text records: each rank's packed rows hold several samples, and
    each step's loss equals plain Transformers run sample by sample (a packed row's loss is its token mean over all
    the samples in it)."""
    import transformers

    model_dir = _tiny_qwen3_5(tmp_path / "hf")
    records = _images_and_records(tmp_path / "data")
    native = _native(DENSE)
    _tiny_native_run(native, model_dir, records, tmp_path)
    # The chunked loss and activation offload of the shipped file: chunked loss is an option being added (its
    # value is checked in the golden report); activation offload is refused by name (golden report). Off here.
    native["features"].update(enable_chunk_loss=False, enable_activation_offload=False)
    packed = _packed_native(model_dir, tmp_path / "packed")  # the same config with neat_packing, same launch
    report, config = _fit(native, tmp_path, capsys, also=((packed, tmp_path / "packed"),))
    _assert_packed_equals_plain_transformers(model_dir, tmp_path / "packed")
    assert "model_id" not in config["model"]["init_args"]["transformers_model"]
    assert "model.model_id qwen3_5 -> none: no ModelHub adapter needed" in report
    ranks = _assert_equals_plain_transformers(
        transformers.Qwen3_5ForConditionalGeneration, model_dir, tmp_path, frozen=None
    )
    assert ranks[0]["recompute_modules"] == native["features"]["recompute_plan"]["apply_modules"]
    for unit in (
        "model.visual.blocks.0",
        "model.language_model.layers.0",
        "model.language_model.layers.1",
        "model.language_model.embed_tokens",
        "lm_head",
    ):
        assert unit in ranks[0]["units"], (unit, ranks[0]["units"])


def test_qwen3_5_samples_equal_its_processor_and_chat_template(tmp_path, monkeypatch):
    """The data path of the Qwen3.5 configs (template ``qwen3_vl_nothink``, collate ``qwen3vl``) on a Qwen3.5
    directory: each sample equals what the model's own processor and chat template give."""
    from tests.test_hf_data import RECORDS, _assert_same, _config, _module, _reference

    model_dir = _tiny_qwen3_5(tmp_path / "hf")
    config = _config(
        model_dir, "qwen3_vl", template=_native(DENSE)["data"]["dataset_param"]["basic_parameters"]["template"]
    )
    assert config["dataloader_param"]["collate_param"]["model_name"] == "qwen3vl"
    dataset = _module(tmp_path, monkeypatch, config)._splits["train"]
    for i, record in enumerate(RECORDS):
        _assert_same(dataset[i], _reference(model_dir, record, tmp_path / "data"))


DENSE_QWEN3_5 = (
    "qwen3_5__qwen3_5_4B_config.yaml",
    "qwen3_5__qwen3_5_9B_config.yaml",
    "qwen3_5__qwen3_5_27B_config.yaml",
    "qwen3_6__qwen3_6_27B_config.yaml",
)


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    return _tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "hf")


@pytest.mark.parametrize("name", DENSE_QWEN3_5)
def test_lightning_mm_plan_for_the_dense_qwen3_5_configs(name, tiny_qwen3_5, tmp_path, capsys):
    """``lightning-mm plan`` of the migrated dense Qwen3.5 / Qwen3.6 configs at the launch script's world size, on
    the meta device, with the tiny Qwen3.5 stand-in (a derived class: no ModelHub adapter)."""
    from lightning_mm.commands.plan_command import plan_from_cli_config

    _, written = _migrate(name, tmp_path, capsys)
    config = yaml.safe_load(written.replace("<RUN>", str(tmp_path.resolve())).replace("<DATA>", str(DATA)))
    model = config["model"]["init_args"]["transformers_model"]
    model.update(init_from_hf_path=str(tiny_qwen3_5), trust_remote_code=False)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(config))
    world = WORLD_SIZES[name]
    text = plan_from_cli_config(["--config", str(tmp_path / "plan.yaml")], world_size=world)
    assert f"world size {world}, mesh (shard={world})" in text, text
    units = text.split("units (", 1)[1].split("<root>", 1)[0]
    for unit in (
        "model.visual.blocks.0",
        "model.visual",
        "model.language_model.layers.1",
        "model.language_model",
        "model.language_model.embed_tokens",
        "lm_head",
    ):
        assert unit in units, (unit, text)
    assert "recomputed (non-reentrant): model.visual.blocks.0" in text
    assert "model.language_model.layers.0" in text.split("recomputed", 1)[1]
    assert "default plan: derived from MMQwen3_5ForConditionalGeneration's Transformers metadata" in text, text


def test_native_tensor_parallel_size_and_tp_plan_migrate_onto_the_fsdp2_keys():
    """MindSpeed MM's ``parallel.tensor_parallel_size`` / ``tp_plan`` (``mindspeed_mm/fsdp/params/parallel_args.py``
    ``TPPlanConfig``: module-pattern lists per style) become ``tensor_parallel_size`` and a Transformers-notation
    ``tp_plan``; the section given to the strategy directly reads the same."""
    from lightning_mm.mindspeed.native_route import migrate_native

    data = yaml.safe_load((DATA / "qwen3vl__qwen3vl_30B_config_v1.yaml").read_text())
    layers = "model.language_model.layers.{*}"
    data["parallel"].update(
        tensor_parallel_size=2,
        tp_plan={
            "colwise_parallel": [f"{layers}.self_attn.q_proj", f"{layers}.mlp.up_proj"],
            "rowwise_parallel": [f"{layers}.self_attn.o_proj"],
            "sequence_parallel": [],
        },
    )
    result = migrate_native(DATA / "x.yaml", data)
    fsdp2 = result.config["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    plan = {
        "model.language_model.layers.*.self_attn.q_proj": "colwise",
        "model.language_model.layers.*.mlp.up_proj": "colwise",
        "model.language_model.layers.*.self_attn.o_proj": "rowwise",
    }
    assert fsdp2["tensor_parallel_size"] == 2 and fsdp2["tp_plan"] == plan
    assert not any("tensor_parallel" in line or "tp_plan" in line for line in result.unmapped), result.unmapped
    assert "parallel.tensor_parallel_size -> fsdp2_config.tensor_parallel_size: 2" in "\n".join(result.mapped)
    config = FSDP2Config.from_dict(fsdp2)
    assert (config.tensor_parallel_size, config.tp_plan) == (2, plan)
    direct = load_fsdp2_config(data)  # the whole native config given to MMFSDP2Strategy(fsdp2_config=...)
    assert (direct.tensor_parallel_size, direct.tp_plan) == (2, plan)
    # a plan without tensor parallelism is not applied, as in MindSpeed MM (apply_tp_modules returns at size 1)
    data["parallel"]["tensor_parallel_size"] = 1
    assert load_fsdp2_config(data).tp_plan is None


def test_the_core_config_knows_only_its_own_keys_and_the_entry_reads_the_native_form():
    """issue #36: FSDP2Config is this project's schema alone; MindSpeed MM's `parallel:` section is read by the
    translation layer's entry, which MMFSDP2Strategy(fsdp2_config=...) calls."""
    section = {"fully_shard_parallel_size": "auto", "fsdp_plan": {"apply_modules": ["layers.{*}"]}}
    with pytest.raises(FSDP2ConfigError, match="unknown FSDP2 config key `fully_shard_parallel_size`"):
        FSDP2Config.from_dict(section)
    assert load_fsdp2_config(section).sub_modules_to_wrap == ["layers.{*}"]


def test_a_lightning_modules_own_native_fsdp2_config_is_read_through_the_entry():
    """A LightningModule's ``fsdp2_config`` attribute may be MindSpeed MM's native form too: the strategy reads it
    through the same entry as its own argument (FSDP2Config.load alone refuses it)."""
    from lightning.pytorch import LightningModule

    from lightning_mm.strategies import MMFSDP2Strategy

    section = {"fully_shard_parallel_size": "auto", "fsdp_plan": {"apply_modules": ["layers.{*}"]}}
    module = LightningModule()
    module.fsdp2_config = section
    strategy = MMFSDP2Strategy()
    strategy.connect(module)
    assert strategy.fsdp2_config == load_fsdp2_config(section)
    given = MMFSDP2Strategy(fsdp2_config=section)
    given.connect(module)
    assert given.fsdp2_config == load_fsdp2_config(section)  # the same config in both places is one config


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        ({"trainer": {}, "model": {}, "data": {}}, "lightning-mm"),
        ({"parallel": {}, "model": {}, "data": {}}, "native"),
        ({"fsdp_plan": {}}, "native-parallel"),
        ({"gpt_args": {}, "parallel": {}}, "single-yaml"),
        ({"dataset_param": {}}, "data"),
        ({"model_id": "qwen2_5vl"}, "model"),
        ({"zero3_size": 8, "param_dtype": "bf16"}, "layerzero"),
        ({"sub_modules_to_wrap": []}, "fsdp2"),
    ],
)
def test_one_entry_tells_each_format(content, kind):
    from lightning_mm.mindspeed.load import detect

    assert detect(content) == kind


def test_native_ulysses_parallel_size_is_the_fsdp2_key_context_parallel_size(tmp_path):
    """``parallel.ulysses_parallel_size`` becomes the FSDP2 config key ``context_parallel_size`` (the strategy
    argument of that name is only its alias): migrate writes it into ``fsdp2_config`` and no strategy argument, the
    section given to the strategy directly reads the same, MindSpeed MM's global batch divides the world by it, and
    the GlobalBatchSize callback derives the accumulation from it before the strategy is set up."""
    import lightning as L

    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.commands.global_batch import GlobalBatchSize
    from lightning_mm.mindspeed.native_route import migrate_native

    data = _native(DENSE)
    data["parallel"]["ulysses_parallel_size"] = 2
    data["training"].update(micro_batch_size=2, gradient_accumulation_steps=3)
    result = migrate_native(DATA / "x.yaml", data, world_size=8)
    strategy_args = result.config["trainer"]["strategy"]["init_args"]
    assert strategy_args["fsdp2_config"]["context_parallel_size"] == 2 and "context_parallel_size" not in strategy_args
    assert "parallel.ulysses_parallel_size -> fsdp2_config.context_parallel_size: 2" in result.mapped
    assert load_fsdp2_config(data).context_parallel_size == 2
    callbacks = [c for c in result.config["trainer"]["callbacks"] if c["class_path"].endswith("GlobalBatchSize")]
    assert callbacks[0]["init_args"] == {"global_batch_size": 2 * (8 // 2) * 3}

    class Data:
        batch_size, max_tokens_per_rank = 2, None

    class Trainer:  # what GlobalBatchSize.setup reads, before the strategy's setup (the layout is not built yet)
        def __init__(self, strategy: MMFSDP2Strategy) -> None:
            self.strategy, self.world_size, self.accumulate_grad_batches, self.datamodule = strategy, 4, 1, Data()

    strategy = MMFSDP2Strategy(fsdp2_config={"context_parallel_size": 2})
    trainer = Trainer(strategy)
    GlobalBatchSize(24).setup(trainer, L.LightningModule(), "fit")  # type: ignore[arg-type]
    assert trainer.accumulate_grad_batches == 24 // (2 * (4 // 2))  # 6: the 2 ranks of a CP group share samples
