"""MindSpeed MM's pattern and plan semantics on its shipped native configs (issue #36, item 4): a ``{*}`` pattern
whose suffix exists in only some layers, experts named in both the FSDP and the EP plan, and ``plan`` that never
reads the data section."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
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

    from lightning_mm.commands.plan_command import main as plan_main
    from lightning_mm.testing.tiny_qwen3_5 import tiny_qwen3_5_moe

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


# ------------------------------------------------------------------------------ values, checked by key
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train_iters", -5, "`training.train_iters`: expected an integer >= 1, got -5"),
        ("micro_batch_size", 0, "`training.micro_batch_size`: expected an integer >= 1, got 0"),
        ("lr_warmup_ratio", 1.5, "`training.lr_warmup_ratio`: expected a number >= 0 and <= 1, got 1.5"),
        ("lr", "abc", "`training.lr`: expected a number >= 0, got 'abc'"),
        ("gradient_accumulation_steps", 2.5, "`training.gradient_accumulation_steps`: expected an integer >= 1"),
        ("clip_grad", -1.0, "`training.clip_grad`: expected a number >= 0, got -1.0"),
        ("adam_beta2", 1.0, "`training.adam_beta2`: expected a number >= 0 and < 1, got 1.0"),
        ("adam_eps", 0, "`training.adam_eps`: expected a number > 0, got 0"),
        ("seed", -1, "`training.seed`: expected an integer >= 0 and <= 4294967295, got -1"),
    ],
)
def test_native_values_out_of_range_are_refused_naming_the_key(key, value, message, tmp_path):
    from lightning_mm.mindspeed.keys import MindSpeedConfigError as MigrateError
    from lightning_mm.mindspeed.native_route import migrate_native

    native = yaml.safe_load((DATA / QWEN3_5_122B).read_text())
    native["training"][key] = value
    with pytest.raises(MigrateError) as err:
        migrate_native(DATA / QWEN3_5_122B, native, base_dir=tmp_path)
    assert message in str(err.value) and QWEN3_5_122B in str(err.value)


def test_native_numbers_written_as_strings_are_read_as_mindspeed_mm_reads_them(tmp_path):
    from lightning_mm.mindspeed.native_route import migrate_native

    native = yaml.safe_load((DATA / QWEN3_5_122B).read_text())
    native["training"].update(lr="1e-5", train_iters=100, lr_warmup_ratio=0.25)  # YAML reads 1e-5 as a string
    config = migrate_native(DATA / QWEN3_5_122B, native, base_dir=tmp_path).config
    assert config["model"]["init_args"]["lr"] == 1e-5 and config["model"]["init_args"]["warmup_steps"] == 25


def test_native_adam_eps_becomes_the_modules_eps(tmp_path):
    from lightning_mm.mindspeed.native_route import migrate_native

    native = yaml.safe_load((DATA / QWEN3_5_122B).read_text())
    native["training"]["adam_eps"] = 1e-5
    result = migrate_native(DATA / QWEN3_5_122B, native, base_dir=tmp_path)
    assert result.config["model"]["init_args"]["eps"] == 1e-5
    assert any(line.startswith("training.adam_eps -> model.init_args.eps") for line in result.mapped), result.mapped


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--train-iters", "-5", "--train-iters needs an integer >= 1, got '-5'"),
        ("--micro-batch-size", "0", "--micro-batch-size needs an integer >= 1, got '0'"),
        ("--lr-warmup-fraction", "1.5", "--lr-warmup-fraction needs a number >= 0 and <= 1, got '1.5'"),
        ("--global-batch-size", "3.5", "--global-batch-size needs an integer >= 1"),
    ],
)
def test_launch_flags_out_of_range_are_refused_naming_the_flag(flag, value, message):
    from lightning_mm.mindspeed.keys import MindSpeedConfigError as MigrateError
    from lightning_mm.mindspeed.launch_script import Launch
    from lightning_mm.mindspeed.megatron_route import migrate as migrate_launch

    with pytest.raises(MigrateError, match=re.escape(message)):
        migrate_launch(Launch(flags=[("--lr", "1e-5"), (flag, value)]))


# ------------------------------------------------------------------------------ LoRA
_LORA_YAML = """\
gpt_args:
  micro_batch_size: 1
  lr: 1.0e-4
  train_iters: 10
lora_args:
  lora_r: 4
  lora_alpha: 8
  lora_dropout: 0.0
  lora_target_modules: v_proj,o_proj,k_proj,q_proj
  lora_register_forward_hook: embed_tokens
model:
  model_id: qwen3_vl
  init_from_hf_path: {hf}
"""


def test_lora_args_of_the_megatron_route_become_the_lora_block(tmp_path):
    """MindSpeed MM's ``lora_args`` (examples/qwen3vl/qwen3vl_lora_sft_30B.yaml: a comma-separated target list,
    PEFT's LoraConfig built from lora_r / lora_alpha / lora_dropout) -> TransformersModel's ``lora``."""
    from lightning_mm.hf.lora import LoRAConfig
    from lightning_mm.mindspeed.keys import MindSpeedConfigError as MigrateError
    from lightning_mm.mindspeed.megatron_route import migrate_yaml

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "qwen3_vl"}')
    path = tmp_path / "job.yaml"
    path.write_text(_LORA_YAML.format(hf=tmp_path / "hf"))
    result = migrate_yaml(path, base_dir=tmp_path)
    lora = result.config["model"]["init_args"]["transformers_model"]["lora"]
    assert lora == {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["v_proj", "o_proj", "k_proj", "q_proj"]}
    LoRAConfig.from_any(lora)
    assert any(n.startswith("lora_args.lora_register_forward_hook") for n in result.notes)
    assert not any("lora_args" in u for u in result.unmapped)
    path.write_text(_LORA_YAML.format(hf=tmp_path / "hf").replace("lora_r: 4", "lora_r: 0"))
    with pytest.raises(MigrateError, match=r"job.yaml: `lora_args.lora_r`: expected an integer >= 1, got 0"):
        migrate_yaml(path, base_dir=tmp_path)


def test_a_bare_lora_target_names_every_module_ending_with_it_as_mindspeed_mm_does():
    """MindSpeed MM's ``lora_utils.is_pattern_match`` (and PEFT's target list): ``q_proj`` names every module
    whose path is ``q_proj`` or ends with ``.q_proj``; targets under ``freeze`` are left out (its Megatron route's
    lora_patch skips frozen targets); a name that matches nothing stays an error."""
    from lightning_mm.hf.lora import LoRAConfig, LoRAConfigError, resolve_targets
    from tests.scenarios.hf_scenarios import tiny_hf_model

    model = tiny_hf_model("qwen2")
    config = LoRAConfig(target_modules=["q_proj", "self_attn.o_proj"])
    expected = [
        name
        for name, _ in model.named_modules()
        if any(name == p or name.endswith("." + p) for p in ("q_proj", "self_attn.o_proj"))
    ]
    assert resolve_targets(model, config) == expected and len(expected) == 2 * model.config.num_hidden_layers
    assert resolve_targets(model, config, frozen=["model.layers.0"]) == [e for e in expected if ".layers.0." not in e]
    with pytest.raises(LoRAConfigError, match="q_projj"):
        resolve_targets(model, LoRAConfig(target_modules=["q_projj"]))


# ------------------------------------------------------------------------------ packing
_PACKED_YAML = """\
gpt_args:
  micro_batch_size: 2
  lr: 1.0e-5
data:
  dataset_param:
    dataset_type: huggingface
    preprocess_parameters:
      model_name_or_path: {hf}
    basic_parameters:
      template: qwen2vl
      dataset: {records}
      cutoff_len: 64
      neat_packing: true
  dataloader_param:
    shuffle: false
"""


def test_a_neat_packing_data_config_migrates_to_a_config_the_data_module_accepts(tmp_path):
    """A data config with ``neat_packing`` is a token budget of cutoff_len per packed row: the micro-batch size
    is not written beside it (MMDataModule refuses a batch_size with a token budget)."""
    from lightning_mm import MMDataModule
    from lightning_mm.mindspeed.megatron_route import migrate_yaml

    (tmp_path / "records.jsonl").write_text("")
    path = tmp_path / "job.yaml"
    path.write_text(_PACKED_YAML.format(hf=tmp_path, records=tmp_path / "records.jsonl"))
    result = migrate_yaml(path, base_dir=tmp_path)
    init_args = result.config["data"]["init_args"]
    assert init_args == {"data_config": str(path)}
    assert any("neat_packing, cutoff_len -> MMDataModule packing" in m for m in result.mapped)
    assert any(n.startswith("--micro-batch-size 2: not written") for n in result.notes)
    data = MMDataModule(**init_args)
    assert data.max_tokens_per_rank == 64


# ------------------------------------------------------------------------------ the job keeps its identity
def _qwen3vl_job(tmp_path: Path) -> tuple[Path, Path]:
    """MindSpeed MM's Qwen3-VL single-YAML launch (examples/qwen3vl: 2 NPUs x 1 node, micro batch 2, global batch
    8) with its tiny stand-in, in a copy of the tree: (launch script, repository root)."""
    import shutil

    from examples.vlm_stand_in import write_job_inputs

    root = tmp_path / "repo"
    shutil.copytree(Path(__file__).resolve().parents[1] / "examples" / "qwen3vl", root / "examples" / "qwen3vl")
    write_job_inputs(root / "runs" / "qwen3vl", "qwen3_vl", "Qwen3-VL-tiny", count=24)
    job = root / "examples" / "qwen3vl" / "qwen3vl_full_sft_8B.yaml"  # the data section's paths: from any directory
    job.write_text(job.read_text().replace("./runs/qwen3vl", str(root / "runs" / "qwen3vl")))
    return root / "examples" / "qwen3vl" / "finetune_qwen3vl_8B.sh", root


def test_migrated_job_runs_as_2_nodes_x_2_processes_keeping_its_global_batch(tmp_path, capsys):
    """The migrated Qwen3-VL job (written for 2 processes on 1 node: global batch 8 = micro batch 2 x 2 ranks x
    accumulation 2), run as 2 nodes x 2 processes on this machine (torchrun --nnodes 2, twice): Lightning sees 4
    ranks on 2 nodes, and the accumulation is recomputed to 1 so that each step still trains on 8 samples. The
    launch lines migrate prints for a 2-node config name both counts."""
    from tests.helpers.scenario_kit import run
    from tests.scenarios import native_scenarios

    script, root = _qwen3vl_job(tmp_path)
    out = tmp_path / "config.yaml"
    migrate.main([str(script), "-o", str(out), "--base-dir", str(root)])
    report = capsys.readouterr().err
    assert "--global-batch-size 8 -> trainer.callbacks: GlobalBatchSize(8)" in report
    config = yaml.safe_load(out.read_text())
    assert config["trainer"]["accumulate_grad_batches"] == 2 and config["trainer"]["devices"] == 2
    config["trainer"].update(
        accelerator="cpu",
        num_nodes=2,
        max_steps=2,
        precision="32-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(tmp_path / "run"),  # LightningCLI writes its config.yaml there
    )
    for callback in config["trainer"]["callbacks"]:
        if "ModelCheckpoint" in callback["class_path"]:
            callback["init_args"].update(dirpath=str(tmp_path / "save"), every_n_train_steps=2)
    config["trainer"]["callbacks"].append(
        {"class_path": "tests.scenarios.native_scenarios.JobShape", "init_args": {"outdir": str(tmp_path)}}
    )
    config["trainer"]["strategy"]["init_args"].pop("process_group_backend", None)
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    from lightning_mm.commands.migrate import launch_lines

    lines = "\n".join(launch_lines(config, str(out)))
    assert "torchrun --nnodes 2 --nproc_per_node 2 --node_rank $NODE_RANK" in lines
    assert "srun --nodes 2 --ntasks-per-node 2" in lines

    run(native_scenarios.fit_config, tmp_path, args={"config": out}, launcher="torchrun", nnodes=2, timeout=600)
    ranks = [json.loads((tmp_path / f"job.rank{r}.json").read_text()) for r in range(4)]
    assert {r["world_size"] for r in ranks} == {4} and {r["num_nodes"] for r in ranks} == {2}
    assert sorted(r["node_rank"] for r in ranks) == [0, 0, 1, 1]
    for shape in ranks:  # 8 = 2 x 4 data-parallel ranks x 1
        assert shape["accumulate_grad_batches"] == 1 and shape["batch_size"] == 2
        assert shape["global_step"] == 2 and shape["micro_batches"] == 2
    _check_a_resume_of_another_model_is_refused(config, out, tmp_path)


def _check_a_resume_of_another_model_is_refused(config: dict, out: Path, tmp_path: Path) -> None:
    """The checkpoint of the 2-node run records its model; ``fit`` of another model (its config.json has another
    depth) that would resume it (``ckpt_path: last`` over the same save directory, as two jobs sharing a ``--save``
    would) is refused before any weight is read, with a sentence naming both models."""
    import shutil
    import subprocess
    import sys

    from lightning_mm.commands.train import IDENTITY_KEY, checkpoint_metadata, model_identity, resolve_ckpt_path

    last = resolve_ckpt_path("last", config["trainer"])
    assert last is not None, list((tmp_path / "save").iterdir())
    recorded = checkpoint_metadata(last)[IDENTITY_KEY]
    assert recorded == model_identity(config["model"]) and recorded["class"] == "Qwen3VLForConditionalGeneration"

    hf = Path(config["model"]["init_args"]["transformers_model"]["init_from_hf_path"])
    other = tmp_path / "other_model"
    shutil.copytree(hf, other)
    text = json.loads((other / "config.json").read_text())
    text["text_config"]["num_hidden_layers"] += 1
    (other / "config.json").write_text(json.dumps(text))
    config["model"]["init_args"]["transformers_model"]["init_from_hf_path"] = str(other)
    config["ckpt_path"] = "last"
    config["trainer"].update(num_nodes=1, max_steps=3)
    second = tmp_path / "other.yaml"
    second.write_text(yaml.safe_dump(config, sort_keys=False))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_mm.cli", "fit", "--config", str(second)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    depth = text["text_config"]["num_hidden_layers"]
    assert (
        f"holds the weights of Qwen3VLForConditionalGeneration (text.num_hidden_layers {depth - 1}), but the config "
        f"trains Qwen3VLForConditionalGeneration (text.num_hidden_layers {depth}); a run never resumes another "
        "model's checkpoint"
    ) in proc.stderr, proc.stderr[-3000:]
    assert "strict loading" not in proc.stderr  # refused before any weight is read


def test_load_of_pretrained_weights_is_not_a_resume(tmp_path):
    """``--load`` of a Hugging Face directory (a converted model) is the starting weights, not "resume from
    --save" (two jobs sharing a save directory would resume each other); only ``--load`` equal to ``--save``
    resumes the job's own checkpoints."""
    from lightning_mm.mindspeed.megatron_route import migrate_yaml

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "qwen3_vl"}')
    path = tmp_path / "job.yaml"
    text = _LORA_YAML.format(hf=tmp_path / "hf")
    text = text.split("lora_args:")[0] + "model:" + text.split("model:")[1]  # no LoRA here
    path.write_text(
        text.replace("  train_iters: 10\n", f"  train_iters: 10\n  load: {tmp_path / 'hf'}\n  save: save\n")
    )
    result = migrate_yaml(path, base_dir=tmp_path)
    assert "ckpt_path" not in result.config
    assert result.config["model"]["init_args"]["transformers_model"]["init_from_hf_path"] == str(tmp_path / "hf")
    assert any("(pretrained weights, not a resume)" in m for m in result.mapped)
    path.write_text(text.replace("  train_iters: 10\n", "  train_iters: 10\n  load: save\n  save: save\n"))
    result = migrate_yaml(path, base_dir=tmp_path)
    assert result.config["ckpt_path"] == "last"
    assert any("(= --save) -> ckpt_path: last" in m for m in result.mapped)


# ------------------------------------------------------------------------------ LoRA + chunked loss, trained
def test_migrated_lora_and_chunked_loss_config_trains_like_peft(tmp_path, capsys):
    """MindSpeed MM's Qwen3.5-4B native config with its ``training.lora`` block (MindSpeed MM's default kind of
    targets: bare names, ``q_proj`` / ``v_proj``) and its chunked loss (``features.enable_chunk_loss``, chunks of 16
    tokens), migrated and run by ``lightning-mm fit`` on 2 CPU ranks with the tiny dense Qwen3.5: each step's loss
    on each rank equals one process of PEFT's LoRA over plain Transformers (same initial adapters, AdamW, fp32, the
    same batches, the full-logits loss) to relative 1e-5."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from tests.test_native_route import DENSE, _fit, _images_and_records, _native, _tiny_native_run, _tiny_qwen3_5

    model_dir = _tiny_qwen3_5(tmp_path / "hf")
    records = _images_and_records(tmp_path / "data")
    native = _native(DENSE)
    _tiny_native_run(native, model_dir, records, tmp_path)
    native["features"].update(enable_chunk_loss=True, enable_activation_offload=False)
    native["features"]["chunkloss_plan"] = {"apply_module": "lm_head", "chunk_size": 16}
    native["training"]["lora"] = {"enable": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    report, config = _fit(native, tmp_path, capsys)
    written = config["model"]["init_args"]["transformers_model"]
    assert written["lora"]["target_modules"] == ["q_proj", "v_proj"] and written["chunk_loss_size"] == 16
    assert "training.lora -> model.init_args.transformers_model.lora" in report

    ranks = [json.loads((tmp_path / f"native.rank{r}.json").read_text()) for r in range(2)]
    batches = [torch.load(tmp_path / f"native.rank{r}.pt", weights_only=True) for r in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
        targets = [n for n, _ in model.named_modules() if n.endswith((".q_proj", ".v_proj"))]
        assert targets  # MindSpeed MM's is_pattern_match: every module whose path ends with the name
        torch.manual_seed(0)  # LoRAConfig's seed: the adapters PEFT creates after it
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        model.train()
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8
        )
        expected: list[list[float]] = [[], []]
        for step in range(2):
            optimizer.zero_grad()
            for rank in range(2):
                loss = model(**batches[rank][step]).loss
                (loss / 2).backward()
                expected[rank].append(float(loss.detach()))
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        got = torch.tensor(ranks[rank]["losses"], dtype=torch.float64)
        want = torch.tensor(expected[rank], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (rank, got.tolist(), want.tolist())
    assert expected[0][0] != expected[0][1]


def test_a_native_config_at_its_launch_world_size_records_mindspeeds_global_batch(tmp_path):
    """Given the launch's world size (16 NPUs for the Qwen3-VL-30B config), the native route records MindSpeed MM's
    global batch there: micro_batch_size x data-parallel ranks x gradient_accumulation_steps."""
    from lightning_mm.mindspeed.native_route import migrate_native

    name = "qwen3vl__qwen3vl_30B_config_v1.yaml"
    native = yaml.safe_load((DATA / name).read_text())
    native["training"].update(micro_batch_size=2, gradient_accumulation_steps=3)
    config = migrate_native(DATA / name, native, base_dir=tmp_path, world_size=16).config
    recorded = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("GlobalBatchSize")]
    assert recorded == [
        {"class_path": "lightning_mm.commands.global_batch.GlobalBatchSize", "init_args": {"global_batch_size": 96}}
    ]


def test_a_global_batch_that_another_world_size_cannot_keep_is_refused_with_the_arithmetic():
    from lightning_mm._utils.global_batch_math import accumulation_for
    from lightning_mm.errors import ConfigError

    assert accumulation_for(8, 2, 2) == 2 and accumulation_for(8, 2, 4) == 1 and accumulation_for(8, 1, 4, 2) == 4
    with pytest.raises(ConfigError, match=r"global batch size 8 cannot be kept on 3 ranks: micro batch 2 x 3 "):
        accumulation_for(8, 2, 3)


# ------------------------------------------------------------------------------ a frozen tower is MindSpeed MM's
def _plan_of(config: dict, tmp_path: Path, world: int = 2) -> tuple:
    """The plan ``lightning-mm plan --config`` resolves (the strategy's own ``plan_for``), and its model."""
    from lightning_mm.commands.plan_command import planned_cli_config

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(config))
    _, _, planned, _, _ = planned_cli_config(["--config", str(path)], world)
    return planned.plan, planned.target


def _mindspeed_match(pattern: str, name: str) -> bool:
    """MindSpeed's ``module_name_match`` as its patterns are written here: the whole name, ``{*}`` one index."""
    return re.fullmatch(re.escape(pattern).replace(r"\{\*\}", r"\d+"), name) is not None


def test_a_frozen_glm4_5v_tower_is_sharded_as_mindspeed_mm_shards_it(tmp_path, monkeypatch):
    """MindSpeed MM's GLM-4.5V launch (examples/glm4.5v: model.json freezes the vision encoder and projector, and
    fsdp2_config.yaml lists no ``ignored_modules``), migrated and planned as ``lightning-mm plan`` plans it. MindSpeed
    MM ignores only what the YAML lists (``get_ignored_params`` in mindspeed_mm/models/transformers/base_model.py:
    none), and ``Glm4VFSDP2Minxin._fully_shard`` (mindspeed_mm/models/transformers/glm4v_moe/glm4_5v.py) shards each
    vision block, the merger, ``model.visual``, ``embed_tokens``, each decoder layer and ``lm_head``, frozen or not.
    This project's default would keep the fully frozen tower out of FSDP: migrate states ``ignored_modules: []``."""
    import shutil

    from lightning_mm.mindspeed.load import migrate_file
    from tests.helpers.derive_models import tiny_model

    corpus = Path(__file__).resolve().parent / "data" / "mindspeed_corpus" / "examples" / "glm4.5v"
    shutil.copytree(corpus, tmp_path / "examples" / "glm4.5v")
    monkeypatch.chdir(tmp_path)
    result, _ = migrate_file(Path("examples/glm4.5v/finetune_glm4_5v_106B.sh"))
    config = yaml.safe_load(yaml.safe_dump(result.config))
    tiny_model("glm4v_moe").save_pretrained(tmp_path / "hf")
    config["model"]["init_args"]["transformers_model"].update(init_from_hf_path=str(tmp_path / "hf"))
    plan, model = _plan_of(config, tmp_path)

    visual = model.model.visual
    assert not any(p.requires_grad for p in visual.parameters())  # the migrated freeze froze the whole tower
    mindspeed_units = [f"model.visual.blocks.{i}" for i in range(len(visual.blocks))] + ["model.visual.merger"]
    layers = model.model.language_model.layers
    mindspeed_units += ["model.language_model.embed_tokens", "lm_head"]
    mindspeed_units += [f"model.language_model.layers.{i}" for i in range(len(layers))]
    assert plan.ignored_modules == ()  # MindSpeed MM: the YAML lists none
    units = {path for unit in plan.units for path in unit.modules}
    assert set(mindspeed_units) <= units, sorted(set(mindspeed_units) - units)
    # the rest of model.visual (MindSpeed MM's model.visual unit) is sharded too: no parameter is kept whole
    assert not plan.ignored_params
    assert "fsdp2_config.yaml ignored_modules: not set -> trainer.strategy.init_args.fsdp2_config" in result.report()
    alone, _ = migrate_file(Path("examples/glm4.5v/fsdp2_config.yaml"))  # no model: kept as written, with a note
    kept = alone.config["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    assert kept == str(tmp_path / "examples" / "glm4.5v" / "fsdp2_config.yaml")
    assert any("sets no ignored_modules: kept as written" in note for note in alone.notes)


def test_a_native_plan_given_to_the_strategy_ignores_only_what_it_lists(tmp_path):
    """MindSpeed MM's native Qwen3-VL config (``freeze: [model.visual]``, ``fsdp_plan`` without
    ``ignored_modules``), given as it is to ``MMFSDP2Strategy(fsdp2_config=...)`` and migrated: both plan what
    MindSpeed MM shards. ``FSDPPlanConfig.ignored_modules`` defaults to ``[]`` (mindspeed_mm/fsdp/params/
    parallel_args.py) and ``get_fsdp_modules`` (mindspeed_mm/fsdp/distributed/fully_shard_parallel.py) wraps every
    module whose name matches an ``apply_modules`` pattern and is not ignored; this project's default would ignore
    the frozen tower, whose blocks the plan wraps (a contradiction it refuses). The same units written as a
    launch-route FSDP2 YAML (``sub_modules_to_wrap``), given directly, plan the same: MindSpeed MM's
    ``get_ignored_params`` (mindspeed_mm/models/transformers/base_model.py) ignores nothing the YAML does not list."""
    from tests.helpers.moe_models import tiny_moe_model

    name = "qwen3vl__qwen3vl_30B_config_v1.yaml"
    native = yaml.safe_load((DATA / name).read_text())
    assert "ignored_modules" not in native["parallel"]["fsdp_plan"] and native["model"]["freeze"] == ["model.visual"]
    tiny_moe_model("qwen3_vl_moe").save_pretrained(tmp_path / "hf")
    transformers_model = {"init_from_hf_path": str(tmp_path / "hf"), "freeze": ["model.visual"]}
    direct = {
        "seed_everything": 0,
        "trainer": {
            "devices": 2,
            "strategy": {"class_path": "lightning_mm.MMFSDP2Strategy", "init_args": {"fsdp2_config": str(DATA / name)}},
        },
        "model": {
            "class_path": "lightning_mm.modules.transformers_module.MMTransformersModule",
            "init_args": {"transformers_model": transformers_model},
        },
    }
    # the same plan as a launch-route FSDP2 YAML (MindSpeed MM's Qwen3-VL units), given directly: the default plan
    # never ignores a frozen tower whose modules the YAML wraps (lightning_mm/hf/default_plans.py)
    launch_yaml = tmp_path / "fsdp2_config.yaml"
    launch_yaml.write_text(yaml.safe_dump({"sub_modules_to_wrap": native["parallel"]["fsdp_plan"]["apply_modules"]}))
    launch = yaml.safe_load(yaml.safe_dump(direct))
    launch["trainer"]["strategy"]["init_args"]["fsdp2_config"] = str(launch_yaml)
    migrated = _migrated(name, tmp_path)
    migrated["model"]["init_args"]["transformers_model"].update(transformers_model, trust_remote_code=False)
    migrated["trainer"]["callbacks"] = []
    for config in (direct, launch, migrated):
        plan, model = _plan_of(config, tmp_path)
        assert not any(p.requires_grad for p in model.model.visual.parameters())
        mindspeed_units = [  # get_fsdp_modules with no ignored module
            n
            for n, _ in model.named_modules()
            if any(_mindspeed_match(p, n) for p in native["parallel"]["fsdp_plan"]["apply_modules"])
        ]
        assert plan.ignored_modules == ()
        assert sorted(path for unit in plan.units for path in unit.modules) == sorted(mindspeed_units)
