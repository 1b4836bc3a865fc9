"""`lightning-mm migrate`'s flag table: every flag maps where the documentation says, one flag at a time."""

import re
from pathlib import Path

import pytest

from lightning_mm.mindspeed.flags import FLAGS, MEGATRON_MODEL_FLAGS, STRATEGY_ARGS
from lightning_mm.mindspeed.launch_script import parse_args
from lightning_mm.mindspeed.megatron_route import migrate

ROOT = Path(__file__).resolve().parents[1]

# flag, value -> (config path, value there); None: the flag alone sets nothing (it is combined after the loop).
EXPECTED = {
    "--use-torch-fsdp2": (None, "trainer.strategy.class_path", "lightning_mm.MMFSDP2Strategy"),
    "--ckpt-format": ("torch", "trainer.strategy.init_args.checkpoint_format", "torch"),
    "--micro-batch-size": ("3", "data.init_args.batch_size", 3),
    "--lr": ("2e-4", "model.init_args.lr", 2e-4),
    "--min-lr": ("1e-6", "model.init_args.min_lr", 1e-6),
    "--weight-decay": ("0.1", "model.init_args.weight_decay", 0.1),
    "--adam-beta1": ("0.8", "model.init_args.betas", [0.8, 0.999]),
    "--adam-beta2": ("0.95", "model.init_args.betas", [0.9, 0.95]),
    "--adam-eps": ("1e-5", "model.init_args.eps", 1e-5),
    "--lr-decay-style": ("linear", "model.init_args.lr_decay_style", "linear"),
    "--lr-warmup-iters": ("7", "model.init_args.warmup_steps", 7),
    "--train-iters": ("90", "trainer.max_steps", 90),
    "--clip-grad": ("1.5", "trainer.gradient_clip_val", 1.5),
    "--bf16": (None, "trainer.precision", "bf16-mixed"),
    "--seed": ("5", "seed_everything", 5),
    "--log-interval": ("4", "trainer.log_every_n_steps", 4),
    "--eval-interval": ("50", "trainer.val_check_interval", 50),
    "--eval-iters": ("2", "trainer.limit_val_batches", 2),
    "--save": ("ckpts", "trainer.callbacks.0.init_args.save_last", "link"),
    "--save-interval": ("20", "trainer.callbacks.0.init_args.every_n_train_steps", 20),
    "--global-batch-size": ("16", "trainer.callbacks.0.init_args.global_batch_size", 16),
    "--context-parallel-size": ("2", "trainer.strategy.init_args.context_parallel_size", 2),
    "--context-parallel-algo": ("ulysses_cp_algo", "trainer.strategy.init_args.context_parallel_algo", "ulysses"),
    "--num-workers": ("8", "data.init_args.num_workers", 8),
    "--encoder-dp-balance": (None, "trainer.strategy.init_args.fsdp2_config.encoder_dp_balance", True),
}
# Flags that are only reported (never silently dropped), with a word of their reason.
REPORTED = {
    "--fp16": "grad scaler",
    "--mm-model": "does not exist",
    "--untie-embeddings-and-output-weights": "model",
    "--load": "does not exist; give pretrained weights as init_from_hf_path, or resume with ckpt_path",
    "--lr-warmup-fraction": "--train-iters",
    "--mm-data": "does not exist",
    "--tensor-model-parallel-size": "tensor parallelism here splits that class (the FSDP2 YAML's tensor_parallel_size",
    "--pipeline-model-parallel-size": "pipeline parallelism",
    "--optimizer-selection": "only AdamW",
    "--no-load-optim": "restores the optimizer",
    "--no-load-rng": "RNG",
    "--no-save-optim": "optimizer state",
    "--no-save-rng": "RNG",
    "--log-tps": "ThroughputMonitor",
    "--mm-tool": "tool definitions",
    "--layerzero": "LayerZero",
    **dict.fromkeys(
        ("--lora-r", "--lora-alpha", "--lora-dropout", "--lora-target-modules"), "TransformersModel's lora"
    ),
    "--layerzero-config": "LayerZero",
    "--use-txt-dynamic-batching": "needs --max-seq-len",
    "--max-seq-len": "only with --use-txt-dynamic-batching",
    "--dynamic-batch-buffer-size": "only with --use-txt-dynamic-batching",
    **dict.fromkeys(MEGATRON_MODEL_FLAGS, "Megatron model or kernel setting"),
}


def _get(config, path):
    node = config
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


@pytest.mark.parametrize("flag", sorted(EXPECTED))
def test_each_flag_maps_to_its_documented_key(flag):
    value, path, expected = EXPECTED[flag]
    result = migrate(parse_args([flag] if value is None else [flag, value]))
    assert _get(result.config, path) == expected
    assert not [u for u in result.unmapped if u.startswith(flag)]
    assert any(flag in m for m in result.mapped), result.mapped


@pytest.mark.parametrize("flag", sorted(REPORTED))
def test_flags_that_cannot_map_alone_are_reported_with_the_reason(flag):
    value = "0.1" if flag == "--lr-warmup-fraction" else "7"  # a fraction is in [0, 1]
    result = migrate(parse_args([flag, value] if flag != "--fp16" else [flag]))
    assert any(u.startswith(flag) and REPORTED[flag] in u for u in result.unmapped), result.unmapped


def test_the_table_is_covered_and_matches_the_documentation():
    noted = {"--fsdp2-config-path", "--distributed-backend", "--lora-register-forward-hook"}
    assert set(FLAGS) == set(EXPECTED) | set(REPORTED) | noted
    documented = set(re.findall(r"`(--[a-z0-9-]+)`", (ROOT / "docs" / "migration.md").read_text()))
    documented -= {
        "--keep-backend",
        "--force",
        "--base-dir",
        "--import-root",
        "--pretrained-dir",
        "--hf-path",
    }  # our options
    assert documented <= set(FLAGS), documented - set(FLAGS)


def test_dynamic_batching_maps_to_packed_token_budget_batches():
    flags = [
        "--use-txt-dynamic-batching",
        "--max-seq-len",
        "4096",
        "--dynamic-batch-buffer-size",
        "200",
        "--micro-batch-size",
        "2",
    ]
    result = migrate(parse_args(flags))
    assert result.config["data"]["init_args"] == {
        "packing": True,
        "max_tokens_per_rank": 4096,
        "packing_buffer_size": 200,
    }
    assert not result.unmapped and any("--micro-batch-size 2: not used" in n for n in result.notes)


def test_strategy_keys_written_by_the_table_are_strategy_arguments():
    flags = ["--fsdp2-config-path", "f.yaml", "--ckpt-format", "torch_dcp", "--distributed-backend", "gloo"]
    launch = parse_args(flags)
    init_args = migrate(launch, keep_backend=True).config["trainer"]["strategy"]["init_args"]
    assert set(init_args) == {"fsdp2_config", "checkpoint_format", "process_group_backend"}
    assert set(init_args) <= STRATEGY_ARGS


def test_a_bad_number_is_reported_not_raised():
    result = migrate(parse_args(["--lr", "fast"]))
    assert result.unmapped == ["--lr fast: --lr needs a number, got 'fast'"]
    assert "lr" not in result.config["model"]["init_args"]


def test_a_new_flag_is_one_table_line(monkeypatch):
    from lightning_mm.mindspeed.flags import _refuse, _strategy_arg, _to

    with pytest.raises(ValueError, match="no `stop_timeoutt` argument"):
        _strategy_arg("stop_timeoutt", float)  # checked against the class's argument list when the table is built
    monkeypatch.setitem(FLAGS, "--stop-timeout", _strategy_arg("stop_timeout", float))
    monkeypatch.setitem(FLAGS, "--max-epochs", _to("trainer.max_epochs", int))
    monkeypatch.setitem(FLAGS, "--use-mcore-models", _refuse("Megatron core models are Megatron's"))
    result = migrate(parse_args(["--stop-timeout", "30", "--max-epochs", "2", "--use-mcore-models"]))
    assert result.config["trainer"]["strategy"]["init_args"] == {"stop_timeout": 30.0}
    assert result.config["trainer"]["max_epochs"] == 2
    assert result.unmapped == ["--use-mcore-models: Megatron core models are Megatron's"]


def test_encoder_dp_balance_is_added_to_the_fsdp2_yaml_inline_and_the_file_is_left_alone(tmp_path):
    from lightning_mm.core.config import FSDP2Config

    fsdp2 = tmp_path / "fsdp2_config.yaml"
    fsdp2.write_text('sharding_size: auto\nrecompute_modules: ["model.layers.{*}"]\n')
    before = fsdp2.read_text()
    flags = ["--use-torch-fsdp2", "--fsdp2-config-path", str(fsdp2), "--encoder-dp-balance"]
    result = migrate(parse_args(flags))
    config = result.config["trainer"]["strategy"]["init_args"]["fsdp2_config"]
    assert config == {"sharding_size": "auto", "recompute_modules": ["model.layers.{*}"], "encoder_dp_balance": True}
    assert FSDP2Config.load(config).encoder_dp_balance and fsdp2.read_text() == before
    assert not result.unmapped and any(m.startswith("--encoder-dp-balance ->") for m in result.mapped)
    fsdp2.write_text("encoder_dp_balance: true\n")  # already set: the path stays
    result = migrate(parse_args(flags))
    assert result.config["trainer"]["strategy"]["init_args"]["fsdp2_config"] == str(fsdp2)
    missing = migrate(parse_args(["--fsdp2-config-path", str(tmp_path / "no.yaml"), "--encoder-dp-balance"]))
    assert any(u.startswith("--encoder-dp-balance: add `encoder_dp_balance: true`") for u in missing.unmapped)
