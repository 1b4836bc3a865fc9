"""Jobs trained from MIGRATED configs on 2 CPU ranks (issue #36 item 4), each against a one-process reference.

* Packing: MindSpeed MM's Qwen3.5-4B native config (tests/data/mindspeed_native, a corpus config) with MindSpeed MM's
  ``neat_packing`` switched on in its data section (``cutoff_len`` tokens per packed row; the corpus' configs leave
  it off), migrated and fitted with a tiny Qwen3.5 stand-in. The reference replays each rank's packed rows with plain
  Transformers, one sample at a time (a packed row's loss is its token mean over all the samples in it).
"""

from __future__ import annotations

import json
from pathlib import Path

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
