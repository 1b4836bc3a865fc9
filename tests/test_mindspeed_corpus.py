"""MindSpeed MM's shipped examples (tests/data/mindspeed_corpus, commit 57069cd5) through ``lightning-mm migrate``.

Each file is migrated from the root of a copy of the tree, as a user runs ``migrate`` in a MindSpeed MM checkout
(in-process; one real CLI call at the end). Checked: the outcome of every file equals ``expected.yaml`` (migrates,
or refused with a documented reason naming the file); every flag a migrated script writes outside comments is
named in its report (an independent scan of the script text); shell the reader cannot run is named and keeps the
rest; and the routes the corpus needs (native-route scripts, Wan model.json, Megatron-route VLM model.json, derived
families) give the configs they should.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from lightning_mm.mindspeed.load import migrate_file
from lightning_mm.mindspeed.refusals import REASONS, Refused

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "mindspeed_corpus"
EXPECTED: dict[str, str] = yaml.safe_load((CORPUS / "expected.yaml").read_text())


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the corpus, as a MindSpeed MM checkout (files under examples/)."""
    root = tmp_path_factory.mktemp("mindspeed_mm")
    shutil.copytree(CORPUS / "examples", root / "examples")
    return root


@pytest.fixture(scope="module")
def results(tree) -> dict[str, tuple[str, str, object]]:
    """file -> (outcome, report or refusal message, migration or None), every file migrated from the tree's root."""
    out: dict[str, tuple[str, str, object]] = {}
    with _cwd(tree):
        for path in sorted((tree / "examples").rglob("*")):
            if not path.is_file():
                continue
            name = path.relative_to(tree).as_posix()
            try:
                result, _ = migrate_file(Path(name))
            except Refused as err:
                out[name] = (f"refused:{err.code}", str(err), None)
            except Exception as err:  # noqa: BLE001 - any other failure is an outcome the test reports by file
                out[name] = (f"error:{type(err).__name__}", str(err), None)
            else:
                out[name] = ("migrates", result.report(), result)
    return out


def test_the_corpus_is_upstreams_examples_with_a_readme():
    readme = (CORPUS / "README.md").read_text()
    assert "57069cd55a8ab16d5affe379a2e2c5f0a4d962b9" in readme and "Ascend/MindSpeed-MM" in readme
    files = {p.relative_to(CORPUS).as_posix() for p in (CORPUS / "examples").rglob("*") if p.is_file()}
    assert files == set(EXPECTED), "expected.yaml and the vendored files differ"
    assert all(name.endswith((".sh", ".json", ".yaml", ".yml")) for name in files)
    assert len([f for f in files if f.endswith(".sh")]) == 129


def test_every_file_migrates_or_is_refused_as_expected(results):
    changed = {name: (EXPECTED[name], got[0]) for name, got in results.items() if got[0] != EXPECTED[name]}
    assert not changed, "outcome changed (expected, got): " + "\n".join(
        f"{name}: {was} -> {now}: {results[name][1][:300]}" for name, (was, now) in sorted(changed.items())
    )


def test_each_refusal_names_its_file_and_a_documented_reason(results):
    docs = (ROOT / "docs" / "migration.md").read_text()
    for code in REASONS:
        assert f"`{code}`" in docs, f"reason {code} is not listed in docs/migration.md"
    for name, (outcome, message, _) in results.items():
        if outcome.startswith("refused:"):
            code = outcome.split(":", 1)[1]
            assert code in REASONS
            assert message.startswith(name), message
            assert f"refused ({code}): {REASONS[code]}" in message


def _flags_written(text: str) -> set[str]:
    """Every ``--flag`` in a shell script outside comments: an independent scan (a ``#`` at a word start begins a
    comment, unless it is inside quotes)."""
    flags: set[str] = set()
    for line in text.splitlines():
        kept, quote = [], ""
        for i, ch in enumerate(line):
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
                break
            kept.append(ch)
        flags |= set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", "".join(kept)))
    return flags


def test_every_flag_a_migrated_script_writes_is_named_in_its_report(results):
    checked = 0
    for name, (outcome, report, _) in results.items():
        if outcome != "migrates" or not name.endswith(".sh"):
            continue
        named = set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", report))
        missing = _flags_written((CORPUS / name).read_text()) - named
        assert not missing, f"{name}: flags written but not named in the report: {sorted(missing)}"
        checked += 1
    assert checked == 47


def test_shell_the_reader_cannot_run_is_named_and_keeps_the_rest(results):
    outcome, report, result = results["examples/qwen2.5vl/finetune_qwen2_5_vl_72b.sh"]
    assert outcome == "migrates"
    assert "shell not evaluated: line 24: NNODES=$(cat $HOSTFILE | wc -l) (command substitution)" in report
    assert "shell not evaluated: line 25: WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))" in report
    assert "torchrun --nnodes {unevaluated:NNODES}: comes from shell that migrate does not run" in report
    assert "--global-batch-size {unevaluated:GBS}: its value comes from shell" in report
    config = result.config  # the flags around the hostfile lines are all kept
    assert config["trainer"]["devices"] == 16 and config["trainer"]["max_steps"] == 10000
    assert config["data"]["init_args"]["data_config"].endswith("examples/qwen2.5vl/data_72b.json")
    assert config["model"]["init_args"]["lr"] == 1e-5
    # a `<placeholder>` value (MASTER_ADDR=<master_ip_address>) is a word, not a redirection ending the command
    from lightning_mm.mindspeed.launch_script import parse_script

    launch = parse_script((CORPUS / "examples/qwen3omni/finetune_qwen3omni.sh").read_text())
    assert launch.script == "pretrain_transformers.py" and len(launch.flags) > 40
    assert launch.launcher["master_addr"] == "<master_ip_address>"
    assert launch.flags[-1] == ("--distributed-backend", "nccl")  # the command ends at `2>&1 | tee ...`


def test_native_route_scripts_take_the_native_route(results, tree):
    from lightning_mm.mindspeed.files import load_yaml as _load_yaml
    from lightning_mm.mindspeed.native_route import migrate_native

    outcome, report, result = results["examples/qwen3_5/finetune_qwen3_5_35B.sh"]
    assert outcome == "migrates"
    yaml_path = tree / "examples/qwen3_5/qwen3_5_35B_config.yaml"
    with _cwd(tree):
        direct = migrate_native(yaml_path, _load_yaml(yaml_path), base_dir=tree)
    strategy = result.config["trainer"]["strategy"]["init_args"]
    assert strategy["fsdp2_config"] == direct.config["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    assert result.config["model"] == direct.config["model"]
    assert (result.config["trainer"]["devices"], result.config["trainer"]["num_nodes"]) == (16, 1)
    assert "torchrun --nproc_per_node 16 -> trainer.devices" in report


def test_wan_model_json_takes_the_diffusers_path(results, tree):
    import inspect

    from lightning_mm.diffusers.flow_matching import WanFlowMatchSchedule
    from lightning_mm.modules.wan_module import MMWanModule

    outcome, report, result = results["examples/wan2.2/A14B/t2v/pretrain_high.sh"]
    assert outcome == "migrates"
    model = result.config["model"]
    assert model["class_path"] == "lightning_mm.modules.wan_module.MMWanModule"
    args = model["init_args"]
    accepted = {  # the arguments of MMWanModule and of the classes its **kwargs pass on to, as LightningCLI reads them
        name for cls in MMWanModule.__mro__ if "__init__" in vars(cls) for name in inspect.signature(cls).parameters
    }
    assert set(args) <= accepted
    assert args["diffusers_model"] == {
        "init_from_path": str(tree / "weights/Wan-AI/Wan2.2-T2V-A14B-Diffusers/transformer")
    }
    assert args["schedule"] == {
        "num_train_timesteps": 1000,
        "shift": 5,
        "sigma_min": 0.0,
        "extra_one_step": True,
        "max_timestep_boundary": 0.417,
        "min_timestep_boundary": 0.0,
    }
    WanFlowMatchSchedule(**args["schedule"])  # every key is one of the schedule's
    assert args["fsdp2_config"] == str(tree / "examples/wan2.2/A14B/fsdp2_config.yaml")
    assert "ckpt_path" not in result.config  # --load names the weights to start from here, not a resume


def test_megatron_route_vlm_and_derived_families_become_transformers_models(results, tree):
    outcome, _, result = results["examples/qwen2.5vl/finetune_qwen2_5_vl_7b.sh"]
    assert outcome == "migrates"
    model = result.config["model"]["init_args"]["transformers_model"]
    # the weights of the Hugging Face directory the job names: its data config's model_name_or_path
    assert model["init_from_hf_path"] == str(tree / "ckpt/hf_path/Qwen2.5-VL-7B-Instruct")
    assert "model_id" not in model  # the class comes from that directory's config.json
    assert "ckpt_path" not in result.config  # --load (MindSpeed MM's Megatron weights) is not a resume here
    for name in ("examples/magistral-2509/finetune_magistral_2509.sh", "examples/glm4.5v/finetune_glm4_5v_106B.sh"):
        outcome, report, result = results[name]
        assert outcome == "migrates", report
        model = result.config["model"]["init_args"]["transformers_model"]
        assert "model_id" not in model and "no ModelHub adapter needed" in report
        assert model["freeze"]  # the frozen towers, in Transformers' module names


def test_lora_flags_and_lora_args_become_transformers_models_lora(results):
    from lightning_mm.hf.lora import LoRAConfig

    expected = {
        "examples/magistral-2509/finetune_magistral_2509_lora.sh": {
            "rank": 8,
            "alpha": 16.0,
            "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
        "examples/qwen3vl/finetune_lora_qwen3vl_30B.sh": {  # lora_args of its single YAML
            "rank": 8,
            "alpha": 16.0,
            "dropout": 0.0,
            "target_modules": ["v_proj", "o_proj", "k_proj", "q_proj"],
        },
    }
    for name, lora in expected.items():
        outcome, report, result = results[name]
        assert outcome == "migrates", report
        assert result.config["model"]["init_args"]["transformers_model"]["lora"] == lora
        LoRAConfig.from_any(lora)  # TransformersModel accepts it
        assert not [u for u in result.unmapped if u.startswith(("--lora", "lora_args"))]


def test_wan_lora_scripts_become_mmwanmodules_diffusers_lora(results, tree):
    """MindSpeed MM's wandit targets (PEFT suffixes: self_attn and cross_attn both have proj_q...) become the same
    linears of diffusers' WanTransformer3DModel blocks, and the config builds a LoRA-adapted tiny Wan model."""
    import torch
    from diffusers import WanTransformer3DModel

    from lightning_mm.diffusers import DiffusersModel
    from tests.scenarios.wan_scenarios import TINY_WAN

    every = [
        f"blocks.{{*}}.{m}"
        for m in ("attn1.to_q", "attn2.to_q", "attn1.to_k", "attn2.to_k", "attn1.to_v", "attn2.to_v")
        + ("attn1.to_out.0", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
    ]
    scripts = {
        "examples/wan2.1/1.3b/t2v/finetune_lora.sh": 16,  # ffn.2 ffn.0 proj_q proj_k proj_v proj_out
        "examples/wan2.1/14b/t2v/finetune_lora.sh": None,
        "examples/wan2.1/14b/i2v/finetune_lora.sh": None,
        "examples/wan2.2/A14B/t2v/finetune_lora_high.sh": 32,  # "proj_q,proj_k,proj_v,proj_out,ffn.0,ffn.2"
        "examples/wan2.2/A14B/t2v/finetune_lora_low.sh": 32,
    }
    for name, rank in scripts.items():
        outcome, report, result = results[name]
        assert outcome == "migrates", report
        lora = result.config["model"]["init_args"]["diffusers_model"]["lora"]
        assert sorted(lora["target_modules"]) == sorted(every), name
        if rank is not None:
            assert (lora["rank"], lora["alpha"]) == (rank, rank)
        assert not [u for u in result.unmapped if u.startswith("--lora")], name
    lora = results["examples/wan2.1/1.3b/t2v/finetune_lora.sh"][2].config["model"]["init_args"]["diffusers_model"]
    model = DiffusersModel({"config": {**TINY_WAN, "_class_name": "WanTransformer3DModel"}, "lora": lora["lora"]})
    adapted = sorted({n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad})
    linears = [
        n
        for n, m in WanTransformer3DModel(**TINY_WAN).named_modules()
        if isinstance(m, torch.nn.Linear) and n.startswith("blocks.")
    ]
    assert adapted == sorted(linears)  # the tiny t2v model's block linears, all of them (t2v has no k_img / v_img)


def test_the_cli_migrates_a_corpus_script_from_the_checkout(tree, capsys):
    out = tree / "qwen2_5_vl_7b.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_mm.cli",
            "migrate",
            "examples/qwen2.5vl/finetune_qwen2_5_vl_7b.sh",
            "-o",
            str(out),
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load(out.read_text())
    assert config["model"]["class_path"].endswith("MMTransformersModule")
    assert "NOT mapped" in proc.stderr and "--tensor-model-parallel-size 1" in proc.stderr
    from lightning_mm.cli import main

    with _cwd(tree):
        assert main(["migrate", "examples/verl_examples/qwen3vl/train_qwen3_vl_8b_grpo_full.sh"]) == 1
    error = capsys.readouterr().err
    assert "examples/verl_examples/qwen3vl/train_qwen3_vl_8b_grpo_full.sh: refused (rl)" in error


def test_newer_upstream_keys_are_named_with_what_they_would_need(tree):
    """Keys of newer MindSpeed MM versions (most are not in 57069cd5: ``git grep`` finds no swap_plan,
    op_replay_scopes, enable_grad_norm_overlap or KV-all-gather size there) added to a shipped native config."""
    from lightning_mm.mindspeed.files import load_yaml as _load_yaml
    from lightning_mm.mindspeed.native_route import migrate_native

    path = tree / "examples/qwen3vl/qwen3vl_30B_config_v1.yaml"
    data = _load_yaml(path)
    data["parallel"]["kv_allgather_cp_size"] = 2
    data["parallel"].setdefault("recompute_plan", {})["op_replay_scopes"] = ["self_attn"]
    data["features"]["swap_plan"] = {"apply_modules": ["model.language_model.layers.{*}"]}
    data["features"]["enable_activation_offload"] = True
    data["training"]["enable_grad_norm_overlap"] = True
    data["training"]["quantization_plan"] = {"recipe_name": "mxfp8", "apply_modules": ["model.language_model"]}
    data["training"]["plugin"] = ["my_plugins/my_model"]
    result = migrate_native(path, data, base_dir=tree)
    for key in (
        "parallel.kv_allgather_cp_size",
        "parallel.recompute_plan.op_replay_scopes",
        "features.swap_plan",
        "features.enable_activation_offload, features.activation_offload_plan",
        "training.enable_grad_norm_overlap",
        "training.quantization_plan",
        "training.plugin",
    ):
        entries = [u for u in result.unmapped if u.startswith(f"{key}: not supported here: ")]
        assert len(entries) == 1 and "would need" in entries[0], (key, result.unmapped)
    report = result.report()
    assert "unknown to lightning-mm migrate" not in report and "not a key of MindSpeed MM" not in report


def test_a_migrated_megatron_route_qwen2_5_vl_job_builds_its_transformers_twin(tree):
    """Qwen2.5-VL's Megatron-route model.json (MindSpeed MM's qwen2vit / lnmlp / qwen2_5_lm towers) migrated with
    ``--hf-path``: the model section builds Transformers' Qwen2.5-VL class from that directory, with the towers the
    model.json freezes frozen (its vision encoder and projector: every ``model.visual.*`` parameter)."""
    from lightning_mm.modules.transformers_module import MMTransformersModule
    from tests.scenarios.hf_scenarios import tiny_hf_model

    reference = tiny_hf_model("qwen2_5_vl")
    reference.save_pretrained(tree / "tiny_qwen2_5_vl")
    with _cwd(tree):
        result, _ = migrate_file(Path("examples/qwen2.5vl/finetune_qwen2_5_vl_7b.sh"), hf_path=tree / "tiny_qwen2_5_vl")
    transformers_model = result.config["model"]["init_args"]["transformers_model"]
    assert transformers_model["init_from_hf_path"] == str(tree / "tiny_qwen2_5_vl")
    module = MMTransformersModule(transformers_model=transformers_model, lr=1e-5)
    module.configure_model()
    assert type(reference).__name__ in [c.__name__ for c in type(module.model).__mro__]
    frozen = {n for n, p in module.model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in reference.named_parameters() if n.startswith("model.visual.")}


def _mindspeed_global_batch(native: dict, world: int) -> int:
    """MindSpeed MM's global batch of a native-route YAML at ``world`` ranks, as its own code computes it
    (mindspeed_mm/fsdp/params/parallel_args.py: dp = world // (tensor x ring_attention x ulysses);
    training_args.py compute_distributed_training: micro_batch_size x dp x gradient_accumulation_steps, None -> 1)."""
    parallel, training = native.get("parallel") or {}, native.get("training") or {}
    sizes = [
        int(parallel.get(k) or 1) for k in ("tensor_parallel_size", "ring_attention_size", "ulysses_parallel_size")
    ]
    dp = world // (sizes[0] * sizes[1] * sizes[2])
    return int(training.get("micro_batch_size") or 1) * dp * int(training.get("gradient_accumulation_steps") or 1)


def test_native_route_scripts_record_mindspeeds_global_batch_at_their_world_size(results, tree):
    from lightning_mm.mindspeed.files import load_yaml as _load_yaml
    from lightning_mm.mindspeed.launch_script import parse_script

    checked = 0
    for name, (outcome, _report, result) in results.items():
        if outcome != "migrates" or not name.endswith(".sh") or result.route != "native":
            continue
        launch = parse_script((CORPUS / name).read_text())
        nproc, nnodes = launch.launcher.get("nproc_per_node", ""), launch.launcher.get("nnodes", "1")
        assert nproc.isdigit() and nnodes.isdigit(), f"{name}: the corpus' native scripts give literal counts"
        native = _load_yaml(tree / launch.config_yaml)
        recorded = [
            c["init_args"]["global_batch_size"]
            for c in result.config["trainer"].get("callbacks", [])
            if c["class_path"].endswith("GlobalBatchSize")
        ]
        assert recorded == [_mindspeed_global_batch(native, int(nproc) * int(nnodes))], name
        checked += 1
    assert checked >= 10, checked


def test_world_size_is_refused_where_migrate_would_ignore_or_contradict_it(tree):
    from lightning_mm.mindspeed.keys import MindSpeedConfigError as MigrateError

    with _cwd(tree):
        with pytest.raises(MigrateError, match="--world-size is read for a native-route config only"):
            migrate_file(Path("examples/qwen2.5vl/finetune_qwen2_5_vl_3b.sh"), world_size=8)
        with pytest.raises(MigrateError, match=r"--world-size 8, but the launch line starts 16 processes"):
            migrate_file(Path("examples/qwen3_5/finetune_qwen3_5_35B.sh"), world_size=8)
        result, _ = migrate_file(Path("examples/qwen3_5/qwen3_5_35B_config.yaml"), world_size=16)
    assert any("GlobalBatchSize(" in m for m in result.mapped)


def test_multi_node_launch_values_reach_the_launch_lines_or_are_named_not_mapped(results):
    """GLM-4.5V's script (NNODES=8, NODE_RANK=0, MASTER_ADDR=localhost, MASTER_PORT=6000, all literal): the node
    count is trainer.num_nodes and the address and port are in the printed torchrun line. Qwen2.5-VL-72B's hostfile
    block ($(...)): each of the four is named NOT mapped, as shell migrate does not run, and no line is printed."""
    from lightning_mm.commands.migrate import launch_lines

    outcome, report, result = results["examples/glm4.5v/finetune_glm4_5v_106B.sh"]
    assert outcome == "migrates" and result.config["trainer"]["num_nodes"] == 8
    lines = "\n".join(launch_lines(result.config, "cfg.yaml", result.rendezvous))
    assert "torchrun --nnodes 8 --nproc_per_node 16 --node_rank $NODE_RANK --master_addr localhost " in lines
    assert "--master_port 6000 -m lightning_mm.cli fit --config cfg.yaml" in lines
    assert "srun --nodes 8 --ntasks-per-node 16" in lines
    for item in ("--master_addr localhost", "--master_port 6000", "--node_rank 0"):
        assert f"torchrun {item} -> the printed torchrun line" in report, (item, report)

    outcome, report, result = results["examples/qwen2.5vl/finetune_qwen2_5_vl_72b.sh"]
    assert outcome == "migrates" and "num_nodes" not in result.config["trainer"]
    assert not launch_lines(result.config, "cfg.yaml", result.rendezvous)
    unmapped = report.split("NOT mapped", 1)[1]
    for key in ("nnodes", "node_rank", "master_addr"):
        assert f"torchrun --{key} {{unevaluated:" in unmapped and "shell that migrate does not run" in unmapped, key
    assert "line 24: NNODES=$(cat $HOSTFILE | wc -l) (command substitution)" in report
    assert "torchrun --master_port 6000: the node count is not known" in unmapped


# ------------------------------------------------------------------------------ every migrated script plans
# The tiny stand-in of each migrated script's model (a real Transformers / diffusers class of the same family, built
# locally): the first matching script-path prefix wins.
_STAND_INS = (
    ("examples/glm4.5v/", "glm4v_moe"),
    ("examples/hunyuanvideo_1.5/", "hunyuan15"),
    ("examples/internvl3.5/", "internvl"),
    ("examples/magistral-2509/", "mistral3"),
    ("examples/qwen2.5vl/", "qwen2_5_vl"),
    ("examples/qwen3_5/finetune_qwen3_5_35B", "qwen3_5_moe"),
    ("examples/qwen3_5/finetune_qwen3_5_122B", "qwen3_5_moe"),
    ("examples/qwen3_5/finetune_qwen3_5_397B", "qwen3_5_moe"),
    ("examples/qwen3_6/finetune_qwen3_6_35B", "qwen3_5_moe"),
    ("examples/qwen3_5/", "qwen3_5"),
    ("examples/qwen3_6/", "qwen3_5"),
    ("examples/qwen3vl/finetune_qwen3vl_8B", "qwen3_vl"),
    ("examples/qwen3vl/finetune_qwen3vl_32B", "qwen3_vl"),
    ("examples/qwen3vl/", "qwen3_vl_moe"),
    ("examples/wan2.", "wan"),
    ("examples/vace/", "wan_vace"),
)


def _save_stand_in(family: str, directory: Path) -> Path:
    if family == "glm4v_moe" or family == "mistral3":
        from tests.helpers.derive_models import tiny_model

        tiny_model(family).save_pretrained(directory)
    elif family in ("internvl", "qwen2_5_vl"):
        from tests.scenarios.hf_scenarios import tiny_hf_model

        tiny_hf_model(family).save_pretrained(directory)
    elif family == "qwen3_5_moe":
        from lightning_mm.testing.tiny_qwen3_5 import tiny_qwen3_5_moe

        tiny_qwen3_5_moe(directory, num_experts=16)  # the 397B's expert_parallel_size 16 divides them
    elif family == "qwen3_5":
        from tests.test_native_route import _tiny_qwen3_5

        _tiny_qwen3_5(directory)
    elif family == "qwen3_vl":
        from tests.helpers.qwen3_vl_family import save_qwen3_vl

        save_qwen3_vl(directory)
    elif family == "qwen3_vl_moe":
        from tests.helpers.moe_models import tiny_moe_model

        tiny_moe_model("qwen3_vl_moe").save_pretrained(directory)
    elif family == "wan_vace":
        from diffusers import WanVACETransformer3DModel

        from tests.scenarios.wan_scenarios import TINY_VACE

        WanVACETransformer3DModel(**TINY_VACE).save_pretrained(directory)
    elif family == "hunyuan15":
        from diffusers import HunyuanVideo15Transformer3DModel

        from tests.scenarios.hunyuan15_scenarios import TINY_HUNYUAN15

        HunyuanVideo15Transformer3DModel(**TINY_HUNYUAN15).save_pretrained(directory)
    else:
        from diffusers import WanTransformer3DModel

        from tests.scenarios.wan_scenarios import TINY_WAN

        WanTransformer3DModel(**TINY_WAN).save_pretrained(directory)
    return directory


def test_every_migrated_launch_script_plans_at_its_world_size(results, tmp_path):
    """Each launch script that migrates to a fit config passes ``lightning-mm plan --config`` (in-process, on the
    meta device) at its own world size (trainer.devices x trainer.num_nodes as migrated; a hostfile script's node
    count is shell migrate does not run, so it is planned on its one-node device count), with the tiny stand-in of
    its model in place of the directory it names. The FSDP2 YAMLs of InternVL 3.5 (remote-code names), Magistral
    (``language_model.embed_tokens``) and Qwen2.5-VL-72B (Megatron names) plan through migrate's module-path
    translation (lightning_mm/mindspeed/module_paths.py)."""
    from lightning_mm.commands.plan_command import plan_from_cli_config

    stand_ins: dict[str, Path] = {}
    planned = []
    failed: dict[str, str] = {}
    shapes: dict[str, str] = {}
    for name, (outcome, _report, result) in results.items():
        if outcome != "migrates" or not name.endswith(".sh"):
            continue
        family = next(f for prefix, f in _STAND_INS if name.startswith(prefix))  # every script has its stand-in
        if family not in stand_ins:
            stand_ins[family] = _save_stand_in(family, tmp_path / "stand_ins" / family)
        config = yaml.safe_load(yaml.safe_dump(result.config))
        init = config["model"]["init_args"]
        if family in ("wan", "wan_vace", "hunyuan15"):
            init["diffusers_model"]["init_from_path"] = str(stand_ins[family])
        else:
            init["transformers_model"].update(init_from_hf_path=str(stand_ins[family]), trust_remote_code=False)
        trainer = config["trainer"]
        world = trainer["devices"] * trainer.get("num_nodes", 1)
        shape = yaml.safe_dump(
            [
                family,
                world,
                trainer["strategy"],
                trainer.get("precision"),
                init.get("transformers_model"),
                init.get("fsdp2_config"),
            ]
        )
        if shape in shapes:  # the same model, plan and world as a script planned already
            if shapes[shape] in failed:
                failed[name] = failed[shapes[shape]]
            else:
                planned.append(name)
            continue
        shapes[shape] = name
        path = tmp_path / (name.replace("/", "__") + ".yaml")
        path.write_text(yaml.safe_dump(config))
        try:
            text = plan_from_cli_config(["--config", str(path)], world_size=world)
        except Exception as err:  # noqa: BLE001 - name the script
            failed[name] = f"{family}, world {world}: {type(err).__name__}: {err}"
            continue
        assert f"world size {world}" in text, (name, text)
        planned.append(name)
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
    assert len(planned) == 47, planned  # every migrated launch script (docs/migration.md)


def test_module_path_rules_name_modules_of_the_transformers_class(tmp_path):
    """Each rule of lightning_mm/mindspeed/module_paths.py (MindSpeed MM's paths of InternVL's remote code,
    Magistral's Transformers 4.57 properties and Qwen2.5-VL's / Qwen3-VL's Megatron towers, read from the upstream
    files the module names) points at a module of the tiny Transformers model of that family; a pattern no rule
    covers is kept as written, and a translated pattern that names no module is still refused by plan, naming it."""
    from lightning_mm.commands.plan_command import plan_from_cli_config
    from lightning_mm.mindspeed.module_paths import FAMILIES, translate
    from tests.helpers.derive_models import tiny_model
    from tests.helpers.qwen3_vl_family import tiny_qwen3_vl
    from tests.scenarios.hf_scenarios import tiny_hf_model

    models = {"mistral3": tiny_model("mistral3"), "internvl": tiny_hf_model("internvl")}
    models["qwen2_5_vl"] = tiny_hf_model("qwen2_5_vl")
    models["qwen3_vl"] = tiny_qwen3_vl()
    for (family, _megatron), paths in FAMILIES.items():
        names = {n for n, _ in models[family].named_modules()}
        for source, target in paths.rules:
            concrete = source.replace("#", "0")
            assert translate(concrete, paths) == target.replace("#", "0"), (family, source)
            assert target.replace("#", "0") in names, (family, target)
    qwen = FAMILIES[("qwen2_5_vl", True)]
    assert translate("text_decoder.decoder.layers.{0-3,7}.mlp", qwen) == "model.language_model.layers.{0-3,7}.mlp"
    assert translate("text_decoder", qwen) is None  # the language model plus lm_head: no one module
    assert translate("language_model.embed_tokens", FAMILIES[("mistral3", False)]) == (
        "model.language_model.embed_tokens"
    )

    wrong = translate("text_decoder.decoder.layers.{*}.self_attention.linear_qkv", qwen)
    assert wrong == "model.language_model.layers.{*}.self_attn.linear_qkv"  # Transformers has q/k/v_proj
    hf = tmp_path / "qwen"
    models["qwen2_5_vl"].save_pretrained(hf)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "devices": 2,
                    "strategy": {
                        "class_path": "lightning_mm.MMFSDP2Strategy",
                        "init_args": {"fsdp2_config": {"sub_modules_to_wrap": [wrong]}},
                    },
                },
                "model": {
                    "class_path": "lightning_mm.modules.transformers_module.MMTransformersModule",
                    "init_args": {"transformers_model": {"init_from_hf_path": str(hf)}},
                },
            }
        )
    )
    with pytest.raises(Exception, match=r"model\.language_model\.layers\.\{\*\}\.self_attn\.linear_qkv"):
        plan_from_cli_config(["--config", str(config)], world_size=2)


def test_migrate_names_each_translated_module_path(results):
    """The report names each rewritten pattern and the upstream file the rule comes from; the YAML's keys are
    written inline (the file is unchanged) with MindSpeed MM's `ignored_modules` default (none)."""
    _, report, result = results["examples/magistral-2509/finetune_magistral_2509.sh"]
    fsdp2 = result.config["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    assert fsdp2["sub_modules_to_wrap"][0] == "model.language_model.embed_tokens" and fsdp2["ignored_modules"] == []
    assert "sub_modules_to_wrap: language_model.embed_tokens -> model.language_model.embed_tokens" in report
    assert "mindspeed_mm/models/transformers/mistral3/mistral3.py" in report
    _, report, result = results["examples/qwen2.5vl/finetune_qwen2_5_vl_72b_fsdp.sh"]
    fsdp2 = result.config["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    assert fsdp2["ignored_modules"] == ["model.visual"] and "lm_head" in fsdp2["sub_modules_to_wrap"]
    assert "checkpoint/vlm_model/converters/qwen2vl.py" in report
    _, report, result = results["examples/internvl3.5/finetune_internvl3_5.sh"]
    fsdp2 = result.config["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    assert "model.vision_tower.encoder.layer.{*}" in fsdp2["recompute_modules"]
