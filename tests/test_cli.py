"""The lightning-mm command: LightningCLI fit from YAML (2 ranks), plan, migrate, help."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "lightning_mm.cli"]


def run(args, timeout=600, check=True):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([*CLI, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def losses(log_dir: Path) -> list[float]:
    metrics = next(log_dir.rglob("metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


def test_help_lists_commands_and_print_config_works():
    out = run(["--help"]).stdout
    for command in ("fit", "plan", "migrate"):
        assert command in out
    printed = run(["fit", "--print_config", "--config", "examples/captioning/config.yaml"]).stdout
    config = yaml.safe_load(printed)
    assert config["trainer"]["strategy"]["class_path"] == "lightning_mm.MMFSDP2Strategy"
    assert config["model"]["class_path"] == "examples.captioning.module.CaptioningModule"


def parse_plan_bytes(text: str) -> dict[str, int]:
    found = {}
    for key in ("parameters", "gradients", "optimizer"):
        match = re.search(rf"{key}\s+[\d.,]+ MiB\s+\(([\d,]+) B\)", text)
        assert match, text
        found[key] = int(match.group(1).replace(",", ""))
    return found


def assert_plan_command_matches_the_run(config: str, probe: Path) -> None:
    """The plan ``lightning-mm plan --config CONFIG`` builds equals the plan each rank of the run applied."""
    from lightning_mm.commands.plan_command import planned_cli_config
    from tests.helpers.probes import plan_record

    here = os.getcwd()
    os.chdir(ROOT)  # the config's own paths are relative to the repository root, as in `run`
    try:
        planned = plan_record(planned_cli_config(["--config", config])[2].plan)
    finally:
        os.chdir(here)
    applied = [json.loads(Path(f"{probe}.rank{r}.json").read_text()) for r in range(2)]
    assert applied[0] == applied[1] == planned


def test_captioning_demo_fits_from_yaml_and_plan_matches_the_sharded_model(tmp_path):
    probe = tmp_path / "memory"
    proc = run(
        [
            "fit",
            "--config",
            "examples/captioning/config.yaml",
            "--trainer.max_steps",
            "30",
            "--trainer.val_check_interval",
            "15",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.callbacks+=tests.helpers.probes.MemoryProbe",
            f"--trainer.callbacks.path={probe}",
            "--trainer.callbacks+=tests.helpers.probes.PlanProbe",
            f"--trainer.callbacks.path={tmp_path / 'plan'}",
        ]
    )
    values = losses(tmp_path)
    assert values[-1] < values[0] * 0.7, values
    # The headline metric: on the progress bar, validated at the last step, in the closing summary, and plotted.
    assert "Summary after 30 steps (last validation at step 30):" in proc.stdout
    assert "val/caption_acc" in proc.stdout and "step 30/30" in proc.stdout
    assert "Epoch 0/-2" not in proc.stdout
    assert next(tmp_path.rglob("metrics.svg")).read_text().startswith("<svg")
    # The accuracies are shares (meta-device init once emptied the torchmetrics states: values of 1e12).
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    accuracies = [float(r[k]) for r in rows for k in ("val/token_acc", "val/caption_acc") if r.get(k)]
    assert accuracies and all(0.0 <= a <= 1.0 for a in accuracies), accuracies
    # A clean run: no warnings (from this project's code or the libraries' known noise), no tips.
    warned = [line for line in proc.stderr.splitlines() if re.search(r"\.py:\d+: ", line) or "Tip:" in line]
    assert not warned, warned
    plan = run(["plan", "--config", "examples/captioning/config.yaml", "--trace-order"]).stdout
    assert "FSDP, world size 2" in plan and "text_decoder.decoder.layers.1" in plan
    assert (
        "image_encoder.blocks.0 -> text_decoder.embedding -> text_decoder.decoder.layers.0 -> "
        "text_decoder.decoder.layers.1 -> text_decoder.output_layer"
    ) in plan
    planned = parse_plan_bytes(plan)
    real = [json.loads(Path(f"{probe}.rank{r}.json").read_text()) for r in range(2)]
    assert planned["parameters"] == max(r["params"] for r in real)
    assert planned["gradients"] == max(r["grads"] for r in real)
    assert planned["optimizer"] == max(r["optimizer"] for r in real)
    # `lightning-mm plan` prints the plan the strategy applied: the same plan, field by field, on every rank.
    assert_plan_command_matches_the_run("examples/captioning/config.yaml", tmp_path / "plan")
    # A bigger world: the plan shrinks accordingly without starting processes.
    plan8 = parse_plan_bytes(run(["plan", "--config", "examples/captioning/config.yaml", "--world-size", "8"]).stdout)
    assert plan8["parameters"] < planned["parameters"] / 3


def test_migration_example_reuses_the_seed_functions_through_import_paths(tmp_path):
    # Constructor callables from YAML import paths, the Megatron (output, loss_fn) form and (loss, extras).
    run(
        [
            "fit",
            "--config",
            "examples/migration/config.yaml",
            "--trainer.max_steps",
            "20",
            "--trainer.val_check_interval",
            "20",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.callbacks+=tests.helpers.probes.PlanProbe",
            f"--trainer.callbacks.path={tmp_path / 'plan'}",
        ]
    )
    values = losses(tmp_path)
    assert values[-1] < values[0] * 0.5, values
    assert_plan_command_matches_the_run("examples/migration/config.yaml", tmp_path / "plan")


def test_migrate_maps_a_mindspeed_launch_and_lists_what_it_cannot(tmp_path):
    out = tmp_path / "config.yaml"
    proc = run(["migrate", "examples/migration/pretrain_custom.sh", "-o", str(out)])
    config = yaml.safe_load(out.read_text())
    trainer = config["trainer"]
    assert trainer["devices"] == 2 and trainer["num_nodes"] == 1
    assert trainer["strategy"]["class_path"] == "lightning_mm.MMFSDP2Strategy"
    here = ROOT / "examples" / "migration"
    # Paths are absolute (taken from the script's folder), so the config works wherever it is written.
    assert trainer["strategy"]["init_args"] == {
        "fsdp2_config": str(here / "fsdp2_config.yaml"),
        "checkpoint_format": "torch_dcp",
    }  # no nccl: the accelerator decides
    assert trainer["max_steps"] == 100 and trainer["precision"] == "bf16-mixed"
    assert trainer["accumulate_grad_batches"] == 2  # 16 / (4 x 2 ranks)
    assert trainer["gradient_clip_val"] == 1.0
    assert trainer["callbacks"][0] == {
        "class_path": "lightning_mm.commands.global_batch.GlobalBatchSize",
        "init_args": {"global_batch_size": 16},
    }  # kept on any world size
    assert trainer["callbacks"][1]["init_args"] == {
        "save_last": "link",
        "dirpath": str(here / "ckpt"),
        "every_n_train_steps": 50,
    }
    model = config["model"]["init_args"]
    assert model["lr"] == 1e-4 and model["min_lr"] == 1e-5 and model["warmup_steps"] == 10
    assert model["model_provider"] == "examples.migration.pretrain_custom.model_provider"
    assert model["forward_step"] == "examples.migration.pretrain_custom.forward_step"
    assert config["data"]["init_args"] == {
        "train_valid_test_datasets_provider": "examples.migration.pretrain_custom.train_valid_test_datasets_provider",
        "batch_size": 4,
    }
    assert config["seed_everything"] == 1234 and config["ckpt_path"] == "last"
    report = proc.stderr
    unmapped = report.split("NOT mapped")[1]
    for flag in (
        "--no-load-optim",
        "--untie-embeddings-and-output-weights",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "--mm-data ./data.json",
    ):
        assert flag in unmapped
    assert "--distributed-backend nccl: left out" in report
    assert "--lr 1.0e-4 -> model.init_args.lr" in report
    # one node: torchrun's rendezvous options are named as not needed (several nodes: the printed launch line)
    assert re.search(r"torchrun --master_port \S+: one node: torchrun's local rendezvous", report), report


def test_migrate_from_a_flag_list_reports_unknown_flags():
    proc = run(["migrate", "--", "--use-torch-fsdp2", "--lr", "2e-4", "--fp16", "--made-up-flag", "3"])
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["init_args"]["lr"] == 2e-4
    assert "--made-up-flag 3: unknown" in proc.stderr and "--fp16" in proc.stderr.split("NOT mapped")[1]


def test_plan_rejects_a_config_error_with_the_key(tmp_path):
    config = yaml.safe_load((ROOT / "examples/captioning/config.yaml").read_text())
    bad = tmp_path / "fsdp2.yaml"
    bad.write_text("sharding_size: auto\nsub_modules_to_wrap: ['text_decoder.decoder.layers.{0-7}']\n")
    config["trainer"]["strategy"]["init_args"]["fsdp2_config"] = str(bad)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run(["plan", "--config", str(path)], check=False)
    assert proc.returncode != 0
    assert "sub_modules_to_wrap" in proc.stderr and "text_decoder.decoder.layers.2" in proc.stderr


@pytest.mark.parametrize("argv", [["migrate"], ["migrate", "missing.sh"]])
def test_migrate_bad_usage(argv):
    proc = run(argv, check=False)
    assert proc.returncode != 0
