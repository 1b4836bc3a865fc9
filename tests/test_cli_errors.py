"""The lightning-mm command: one-line errors, checkpoints that never cause imports, no Lightning for light commands."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
CAPTIONING = "examples/captioning/config.yaml"


def run(args, extra_path=None, env=None, timeout=300):
    path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    full_env.pop("LIGHTNING_MM_TRACEBACK", None) if "LIGHTNING_MM_TRACEBACK" not in (env or {}) else None
    return subprocess.run(
        [sys.executable, "-m", "lightning_mm.cli", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def planted(tmp_path):
    """A module that records being imported, importable from the test's PYTHONPATH (as an attacker would hope)."""
    (tmp_path / "planted_mod.py").write_text(
        "from pathlib import Path\nPath(__file__).with_name('IMPORTED').write_text('yes')\n"
        "class Planted:\n    pass\n\ndef provider(*args, **kwargs):\n    return None\n"
    )
    return tmp_path


# ------------------------------------------------------------------------ a checkpoint never causes an import
def test_checkpoint_class_path_is_never_imported(planted):
    ckpt = planted / "foreign.ckpt"
    torch.save({"hyper_parameters": {"_class_path": "planted_mod.Planted"}, "state_dict": {}}, ckpt)
    proc = run(["validate", "--config", CAPTIONING, "--ckpt_path", str(ckpt)], extra_path=planted)
    assert not (planted / "IMPORTED").exists(), "the checkpoint's _class_path was imported"
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lightning-mm validate: error: checkpoint ") and "'planted_mod.Planted'" in last
    assert "Traceback" not in proc.stderr


def test_checkpoint_hyperparameters_are_data_compared_with_the_config(planted):
    # Same class as the config, but a callable hyperparameter naming the planted module: a warning, no import.
    ckpt = planted / "same_class.ckpt"
    hparams = {"_class_path": "examples.captioning.module.CaptioningModule", "model_provider": "planted_mod.provider"}
    torch.save({"hyper_parameters": hparams, "state_dict": {}}, ckpt)
    proc = run(
        ["validate", "--config", CAPTIONING, "--ckpt_path", str(ckpt), "--trainer.devices", "1"], extra_path=planted
    )
    assert not (planted / "IMPORTED").exists(), "a callable named by the checkpoint was imported"
    assert "model_provider: 'planted_mod.provider' in the checkpoint, None in the config" in proc.stderr
    assert proc.returncode == 1  # the empty state dict then fails to load, as one line
    assert proc.stderr.strip().splitlines()[-1].startswith("lightning-mm validate: error: ")


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_checkpoint_that_would_run_code_is_refused_before_anything_is_built(tmp_path):
    from lightning_mm.commands.train import checkpoint_hyperparameters
    from lightning_mm.errors import ConfigError

    ckpt = tmp_path / "pickled.ckpt"
    torch.save({"hyper_parameters": {"x": _RunsCode()}}, ckpt)
    with pytest.raises(ConfigError, match=r"cannot read checkpoint .* safely \(weights_only\): .*posix.system"):
        checkpoint_hyperparameters(ckpt)
    legacy = tmp_path / "legacy.ckpt"  # the pre-zip format cannot be memory-mapped: read normally
    torch.save({"hyper_parameters": {"lr": 0.1}}, legacy, _use_new_zipfile_serialization=False)
    assert checkpoint_hyperparameters(legacy) == {"lr": 0.1}
    assert checkpoint_hyperparameters(tmp_path / "absent.ckpt") is None


def test_compare_hyperparameters_accepts_what_the_cli_saved():
    from lightning_mm.commands.train import compare_hyperparameters

    config = {"class_path": "a.B", "init_args": {"lr": 0.1, "fn": compare_hyperparameters, "betas": (0.9, 0.99)}}
    saved = {
        "_class_path": "a.B",
        "_instantiator": "x.y",
        "lr": 0.1,
        "betas": [0.9, 0.99],
        "fn": "lightning_mm.commands.train.compare_hyperparameters",
    }
    assert compare_hyperparameters(saved, config, "c.ckpt") == []
    assert compare_hyperparameters({**saved, "lr": 0.2}, config, "c.ckpt") == [
        "lr: 0.2 in the checkpoint, 0.1 in the config"
    ]


def test_cli_appends_the_working_directory_so_it_never_shadows_installed_modules(tmp_path, monkeypatch):
    from lightning_mm import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cli._add_working_directory()
    assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1


# ------------------------------------------------------------------------------------------ one-line errors
def _bad_fsdp2_config(tmp_path: Path) -> Path:
    config = yaml.safe_load((ROOT / CAPTIONING).read_text())
    bad = tmp_path / "fsdp2.yaml"
    bad.write_text("sharding_size: auto\nsub_module_to_wrap: ['text_decoder.decoder.layers.{*}']\n")
    config["trainer"]["strategy"]["init_args"]["fsdp2_config"] = str(bad)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("command", ["fit", "plan"])
def test_a_misspelt_fsdp2_key_is_one_line(tmp_path, command):
    proc = run([command, "--config", str(_bad_fsdp2_config(tmp_path))])
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"lightning-mm {command}: error: unknown FSDP2 config key `sub_module_to_wrap` in "
        f"{tmp_path / 'fsdp2.yaml'}; did you mean `sub_modules_to_wrap`?"
    ], proc.stderr
    assert "Traceback" not in proc.stderr


def test_traceback_on_request(tmp_path):
    config = str(_bad_fsdp2_config(tmp_path))
    for args, env in (
        (["plan", "--config", config, "--traceback"], None),
        (["plan", "--config", config], {"LIGHTNING_MM_TRACEBACK": "1"}),
    ):
        proc = run(args, env=env)
        assert proc.returncode != 0 and "Traceback (most recent call last)" in proc.stderr
        assert "did you mean `sub_modules_to_wrap`" in proc.stderr


def test_migrate_given_the_python_file_and_convert_with_a_missing_source_are_one_line(tmp_path):
    proc = run(["migrate", "examples/migration/pretrain_custom.py"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "pretrain_custom.py is the entry script; give the shell script" in proc.stderr.strip().splitlines()[-1]
    script = tmp_path / "no_launch.sh"
    script.write_text("export A=1\necho hello\n")
    proc = run(["migrate", str(script)])
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"lightning-mm migrate: error: {script}: refused (not-training): a helper script that starts no training "
        "(install, patch, data preprocessing, Ray cluster start); no torchrun / python launch line"
    ]
    proc = run(["convert", "dcp-to-torch", str(tmp_path / "missing.ckpt"), str(tmp_path / "out.pt")])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "missing.ckpt" in proc.stderr


def test_a_bug_keeps_its_traceback():
    from lightning_mm.commands.failure import user_error

    def bug():
        return {}["key"]  # a KeyError raised here, in a test file, is not a lightning_mm error

    with pytest.raises(KeyError) as caught:
        bug()
    assert user_error(caught.value) is None


def test_an_error_raised_by_lightning_mm_code_is_found_through_its_wrappers():
    from lightning_mm.commands.failure import one_line, user_error
    from lightning_mm.core.config import FSDP2Config

    try:
        try:
            FSDP2Config.from_dict({"sharding_size": "auto", "ignored_module": []})
        except Exception as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        found = user_error(outer)
    assert found is not None and "did you mean `ignored_modules`" in one_line(found)


# ------------------------------------------------------------------------------ light commands stay light
def _imported_top_level_modules(stderr: str) -> set[str]:
    """Top-level module names from ``python -X importtime`` output."""
    return {
        line.rsplit("|", 1)[-1].strip().split(".")[0] for line in stderr.splitlines() if line.startswith("import time:")
    }


@pytest.mark.parametrize(
    "args, allowed",
    [
        (["--help"], set()),
        (["migrate", "examples/migration/pretrain_custom.sh"], set()),
        (["convert", "--help"], set()),
        (["env"], set()),
    ],
)
def test_commands_that_do_not_train_import_neither_lightning_nor_transformers(args, allowed):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lightning_mm.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    heavy = _imported_top_level_modules(proc.stderr) & {"lightning", "pytorch_lightning", "transformers"}
    assert heavy <= allowed, (args, heavy)
