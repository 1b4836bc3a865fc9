"""Jobs trained from MIGRATED configs on 2 CPU ranks (issue #36 item 4), each against a one-process reference.

* An LLM: the corpus ships none, so a minimal MindSpeed MM launch script for a Qwen3 causal LM is written (the
  flags of MindSpeed MM's FSDP2 launches, a Transformers-route model.json naming the model directory, MindSpeed MM's
  FSDP2 YAML keys, and an entry script whose ``train_valid_test_datasets_provider`` gives the tokens:
  tests/helpers/migrated_llm_entry.py), migrated and fitted; the reference is plain Transformers' Qwen3ForCausalLM.
  (MindSpeed MM's data configs serve only its VLM templates here: none is built in for a text-only Qwen3.)

The packed migrated config trains in the dense Qwen3.5 launch of tests/test_native_route.py (the same model), the
migrated Wan t2v and Wan LoRA configs in the Wan launch of tests/test_wan.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

LLM_LAUNCH = """#!/bin/bash
NPUS_PER_NODE=2
NNODES=1
DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \\
    --nnodes $NNODES
"
GPT_ARGS="
    --use-torch-fsdp2 \\
    --fsdp2-config-path {fsdp2} \\
    --micro-batch-size 2 \\
    --global-batch-size 4 \\
    --lr 5.0e-3 \\
    --lr-decay-style constant \\
    --weight-decay 0 \\
    --adam-beta1 0.9 \\
    --adam-beta2 0.999 \\
    --clip-grad 0.0 \\
    --train-iters 2 \\
    --seed 42
"
torchrun $DISTRIBUTED_ARGS tests/helpers/migrated_llm_entry.py \\
    $GPT_ARGS \\
    --mm-model {model} \\
    --distributed-backend nccl
"""


def _tiny_qwen3_llm(directory: Path) -> Path:
    """A tiny Qwen3ForCausalLM directory (Transformers' class, random weights, saved locally)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(4)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def test_a_migrated_qwen3_llm_launch_trains_like_plain_transformers(tmp_path):
    """A MindSpeed MM FSDP2 launch script for a Qwen3 causal LM (model.json with ``init_from_hf_path``, an FSDP2 YAML
    with MindSpeed MM's keys, the entry script's dataset provider), migrated and run by ``lightning-mm fit`` on 2
    CPU ranks: each step's loss on each rank equals one process of plain Transformers' Qwen3ForCausalLM (same
    AdamW, fp32, the ranks' batches, gradients averaged) to relative 1e-5."""
    import transformers

    from lightning_mm.commands.migrate import migrate_file
    from tests.helpers.scenario_kit import run
    from tests.scenarios import native_scenarios
    from tests.test_native_route import _assert_equals_plain_transformers

    model_dir = _tiny_qwen3_llm(tmp_path / "hf")
    (tmp_path / "model.json").write_text(json.dumps({"init_from_hf_path": str(model_dir)}))
    fsdp2 = {
        "sharding_size": "auto",
        "sub_modules_to_wrap": ["model.embed_tokens", "model.layers.{*}", "lm_head"],
        "recompute_modules": ["model.layers.{*}"],
        "param_dtype": "fp32",  # bf16 in a real job; fp32 for the 1e-5 comparison
        "reduce_dtype": "fp32",
        "reshard_after_forward": True,
    }
    (tmp_path / "fsdp2_config.yaml").write_text(yaml.safe_dump(fsdp2))
    launch = tmp_path / "pretrain_qwen3.sh"
    launch.write_text(LLM_LAUNCH.format(fsdp2=tmp_path / "fsdp2_config.yaml", model=tmp_path / "model.json"))
    result, _ = migrate_file(launch, base_dir=ROOT, import_root=ROOT)
    config = yaml.safe_load(yaml.safe_dump(result.config))
    data = config["data"]["init_args"]
    assert data["train_valid_test_datasets_provider"] == (
        "tests.helpers.migrated_llm_entry.train_valid_test_datasets_provider"
    ), data
    assert config["model"]["init_args"]["transformers_model"]["init_from_hf_path"] == str(model_dir)
    config["trainer"].update(
        accelerator="cpu",
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path / "run"),
        callbacks=[{"class_path": "tests.scenarios.native_scenarios.Recorder", "init_args": {"outdir": str(tmp_path)}}],
    )
    assert config["trainer"]["devices"] == 2 and config["trainer"]["max_steps"] == 2
    config["model"]["init_args"].update(log_grad_norm=False)
    data["num_workers"] = 0
    out = tmp_path / "config.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    run(native_scenarios.fit_config, tmp_path, args={"config": out})
    ranks = _assert_equals_plain_transformers(transformers.Qwen3ForCausalLM, model_dir, tmp_path, frozen=None)
    assert ranks[0]["recompute_modules"] == ["model.layers.{*}"]
    assert {"model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"} <= set(ranks[0]["units"])
