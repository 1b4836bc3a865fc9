"""`lightning-mm migrate` output trains as written: the example launch, migrated into another folder, then fit."""

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from lightning_mm.mindspeed.flags import STRATEGY_ARGS
from lightning_mm.mindspeed.launch_script import parse_args
from lightning_mm.mindspeed.megatron_route import migrate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "migration"


def cli(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "lightning_mm.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_migrated_example_trains_without_edits(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pretrain_custom.sh", "pretrain_custom.py", "fsdp2_config.yaml"):
        shutil.copy(EXAMPLE / name, project / name)
    out = tmp_path / "elsewhere" / "config.yaml"
    out.parent.mkdir()
    # Migrated from the repository root (not the script's folder), written to a third folder.
    proc = cli(["migrate", str(project / "pretrain_custom.sh"), "-o", str(out)], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(out.read_text())
    assert config["trainer"]["strategy"]["init_args"]["fsdp2_config"] == str(project / "fsdp2_config.yaml")
    assert "process_group_backend" not in config["trainer"]["strategy"]["init_args"]
    assert (
        config["data"]["init_args"]["train_valid_test_datasets_provider"]
        == "pretrain_custom.train_valid_test_datasets_provider"
    )
    assert f"# Run from {project}:" in out.read_text()
    # Train from it as written (two steps instead of 100: a command-line override, not an edit).
    proc = cli(
        ["fit", "--config", str(out), "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"], cwd=project
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "`max_steps=2` reached" in proc.stderr + proc.stdout
    for noise in ("view tensor", "DTensor random operators", "model summary", "Tip:"):
        assert noise not in proc.stderr, noise


def test_a_provider_loader_with_another_batch_size_than_the_launch_is_refused(tmp_path):
    """MBS 4 / GBS 16 on 2 ranks: accumulate_grad_batches 2 assumes loaders of 4 samples. A provider whose
    DataLoader holds 8 would train with a global batch of 32: refused at setup, naming both sizes."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pretrain_custom.sh", "fsdp2_config.yaml"):
        shutil.copy(EXAMPLE / name, project / name)
    source = (EXAMPLE / "pretrain_custom.py").read_text()
    assert "DataLoader(dataset, batch_size=4," in source
    (project / "pretrain_custom.py").write_text(
        source.replace("DataLoader(dataset, batch_size=4,", "DataLoader(dataset, batch_size=8,")
    )
    out = tmp_path / "config.yaml"
    proc = cli(["migrate", str(project / "pretrain_custom.sh"), "-o", str(out)], cwd=project)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(out.read_text())
    assert config["data"]["init_args"]["batch_size"] == 4
    assert config["trainer"]["devices"] * config["trainer"]["accumulate_grad_batches"] * 4 == 16
    assert "a DataLoader it returns must have this batch size" in proc.stderr
    proc = cli(
        ["fit", "--config", str(out), "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false"], cwd=project
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "batch_size=4, but the train DataLoader that train_valid_test_datasets_provider returns has batch size 8"
    ) in proc.stderr


def test_the_batch_size_check_of_provider_loaders():
    import pytest
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mm import MMDataModule

    data = TensorDataset(torch.arange(16))
    MMDataModule(lambda: (DataLoader(data, batch_size=4), None, None), batch_size=4).setup()
    MMDataModule(lambda: (DataLoader(data, batch_size=8), data, None)).setup()  # no batch_size given: nothing to check
    with pytest.raises(ValueError, match=r"batch_size=4, but the val DataLoader .* has batch size 8"):
        MMDataModule(lambda: (data, DataLoader(data, batch_size=8), None), batch_size=4).setup()
    with pytest.raises(ValueError, match=r"batch_size=2, but the train DataLoader given to MMDataModule has batch "):
        MMDataModule(train_dataset=DataLoader(data, batch_size=4), batch_size=2)
    sampled = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="has batch size set by its batch_sampler"):
        MMDataModule(lambda: (sampled, None, None), batch_size=2).setup()


def test_backend_is_kept_only_on_request():
    launch = parse_args(["--use-torch-fsdp2", "--distributed-backend", "hccl"])
    assert "process_group_backend" not in migrate(launch).config["trainer"]["strategy"]["init_args"]
    kept = migrate(launch, keep_backend=True).config["trainer"]["strategy"]["init_args"]
    assert kept["process_group_backend"] == "hccl"


def test_strategy_argument_list_matches_the_class():
    from lightning_mm import MMFSDP2Strategy

    assert set(inspect.signature(MMFSDP2Strategy.__init__).parameters) - {"self"} == STRATEGY_ARGS
