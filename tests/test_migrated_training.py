"""Jobs trained from MIGRATED configs on 2 CPU ranks (issue #36 item 4), each against a one-process reference.

* An LLM: the corpus ships none, so a minimal MindSpeed MM launch script for a Qwen3 causal LM is written (the
  flags of MindSpeed MM's FSDP2 launches, a Transformers-route model.json naming the model directory, MindSpeed MM's
  FSDP2 YAML keys, and an entry script whose ``train_valid_test_datasets_provider`` gives the tokens:
  tests/migrated_llm_entry.py), migrated and fitted; the reference is plain Transformers' Qwen3ForCausalLM.
  (MindSpeed MM's data configs serve only its VLM templates here: none is built in for a text-only Qwen3.)
* Packing: MindSpeed MM's Qwen3.5-4B native config (tests/data/mindspeed_native, a corpus config) with MindSpeed MM's
  ``neat_packing`` switched on in its data section (``cutoff_len`` tokens per packed row; the corpus' configs leave
  it off), migrated and fitted with a tiny Qwen3.5 stand-in. The reference replays each rank's packed rows with plain
  Transformers, one sample at a time (a packed row's loss is its token mean over all the samples in it).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.test_native_route import _fit


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


def test_a_migrated_config_with_neat_packing_trains_like_plain_transformers(tmp_path, capsys):
    """MindSpeed MM's Qwen3.5-4B native config with ``neat_packing: true`` and ``cutoff_len: 96`` in its data
    section, migrated and run by ``lightning-mm fit`` on 2 CPU ranks with a tiny dense Qwen3.5 (gated-delta-net and
    full-attention layers): each rank's packed rows hold several samples, and each step's loss on each rank equals
    plain Transformers run sample by sample in one process (fp32, relative 1e-5)."""
    import torch

    from tests.test_native_route import DENSE, _native, _tiny_native_run, _tiny_qwen3_5

    model_dir = _tiny_qwen3_5(tmp_path / "hf")
    records = _text_records(tmp_path / "data")
    native = _native(DENSE)
    _tiny_native_run(native, model_dir, records, tmp_path)
    native["features"].update(enable_chunk_loss=False, enable_activation_offload=False)
    native["data"]["dataset_param"]["basic_parameters"].update(neat_packing=True, cutoff_len=96)
    report, config = _fit(native, tmp_path, capsys)
    data = config["data"]["init_args"]
    assert "batch_size" not in data, data  # a token budget of cutoff_len per row, read from the data section
    ranks = [json.loads((tmp_path / f"native.rank{r}.json").read_text()) for r in range(2)]
    batches = [torch.load(tmp_path / f"native.rank{r}.pt", weights_only=True) for r in range(2)]
    expected = _packed_reference(model_dir, batches)
    for rank in range(2):
        got = torch.tensor(ranks[rank]["losses"], dtype=torch.float64)
        want = torch.tensor(expected[rank], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (rank, got.tolist(), want.tolist())
    assert expected[0][0] != expected[0][1]


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
torchrun $DISTRIBUTED_ARGS tests/migrated_llm_entry.py \\
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
    from tests import native_scenarios
    from tests.scenario_kit import run
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
        "tests.migrated_llm_entry.train_valid_test_datasets_provider"
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
        callbacks=[{"class_path": "tests.native_scenarios.Recorder", "init_args": {"outdir": str(tmp_path)}}],
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
