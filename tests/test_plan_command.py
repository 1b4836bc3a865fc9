"""`lightning-mm plan` plans for the cluster given by --world-size, whatever the config's own devices are."""

from pathlib import Path

import pytest
import yaml

from lightning_mm.commands.plan_command import plan_from_cli_config, world_size_of
from lightning_mm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def hsdp_config(tmp_path: Path, sharding_size: int = 8, devices: int = 2, accelerator: str = "cuda") -> Path:
    """The captioning config with `sharding_size: 8`, for an accelerator this machine need not have."""
    fsdp2 = tmp_path / "fsdp2.yaml"
    fsdp2.write_text(
        yaml.safe_dump({"sharding_size": sharding_size, "sub_modules_to_wrap": ["text_decoder.decoder.layers.{*}"]})
    )
    config = yaml.safe_load((ROOT / "examples/captioning/config.yaml").read_text())
    config["trainer"].update(accelerator=accelerator, devices=devices, num_nodes=1)
    config["trainer"]["strategy"]["init_args"]["fsdp2_config"] = str(fsdp2)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_plan_hsdp_for_64_ranks_from_a_config_with_2_devices(tmp_path):
    text = plan_from_cli_config(["--config", str(hsdp_config(tmp_path))], world_size=64)
    assert "FSDP2 sharding plan: HSDP, world size 64, mesh (replicate=8 x shard=8)" in text
    assert "per-rank parameter shapes (parallel layout: world 64 = mesh (replicate=8 x shard=8); " in text


def test_plan_without_world_size_checks_the_config_devices(tmp_path):
    with pytest.raises(ValueError, match="8 does not divide the world size 2"):
        plan_from_cli_config(["--config", str(hsdp_config(tmp_path))])
    text = plan_from_cli_config(["--config", str(hsdp_config(tmp_path, devices=16))])
    assert "HSDP, world size 16, mesh (replicate=2 x shard=8)" in text


def test_world_size_from_the_config():
    assert world_size_of(2, 4) == 8 and world_size_of("0,1,2", None) == 3 and world_size_of([0, 1], 1) == 2
    with pytest.raises(ConfigError, match="give --world-size"):
        world_size_of("auto", 1)


def test_planning_a_cli_config_leaves_the_process_seed_and_environment_alone(tmp_path):
    """A config's `seed_everything` must not leak out of `plan` (PL_GLOBAL_SEED reaches every process started
    later, and Lightning's samplers read it)."""
    import os
    import random

    import torch

    from lightning_mm.commands.plan_command import _load_cli

    config = hsdp_config(tmp_path, devices=8)
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "seed_everything": 1234}))
    before = (os.environ.get("PL_GLOBAL_SEED"), random.random(), torch.rand(1))
    random.seed(7)
    torch.manual_seed(7)
    expected = (random.random(), torch.rand(1))
    random.seed(7)
    torch.manual_seed(7)
    _load_cli(["--config", str(config)])
    assert plan_from_cli_config(["--config", str(config)])  # the whole command too
    assert os.environ.get("PL_GLOBAL_SEED") == before[0]
    assert (random.random(), torch.rand(1)) == expected


@pytest.mark.parametrize(
    ("name", "text", "kind"),
    [
        ("native.yaml", "parallel:\n  fully_shard_parallel_size: auto\nmodel: {}\n", "native"),
        ("single.yaml", "gpt_args:\n  lr: 1.0e-5\n", "single-yaml"),
        ("model.json", '{"model_id": "qwen2_5vl"}', "model"),
        ("run.sh", "torchrun pretrain_vlm.py --mm-data data.json\n", "launch script"),
    ],
)
def test_plan_refuses_a_mindspeed_file_and_says_to_migrate_it(tmp_path, name, text, kind):
    """The format is told by lightning_mm.mindspeed.load (issue #36): a MindSpeed MM file given to `plan --config`
    is one sentence naming it and the `migrate` command, before anything is built."""
    from lightning_mm.commands.plan_command import main
    from lightning_mm.mindspeed.keys import MindSpeedConfigError

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(MindSpeedConfigError, match=rf"is a MindSpeed MM {kind} file.*lightning-mm migrate {path}"):
        main(["--config", str(path), "--world-size", "2"])
