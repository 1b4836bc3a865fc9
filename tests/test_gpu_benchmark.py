"""benchmarks/gpu_throughput.py, the GPU benchmark, on this CPU machine: its refusal without a GPU, and its whole
path (eager and per-block compiled contenders, summary, Markdown rows) on 2 CPU ranks with a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_throughput.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LMM_BENCH_RESULTS": str(tmp_path / "res")}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "ranks")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_exits_with_a_clear_message(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode != 0
    assert "no CUDA GPU is visible; this benchmark needs one" in proc.stderr
    assert not (tmp_path / "res").exists()


def test_bad_arguments_are_refused_by_name(tmp_path):
    proc = _run(tmp_path, "--device", "tpu")
    assert proc.returncode == 2 and "--device" in proc.stderr


def test_cpu_path_runs_every_contender_and_writes_json_and_markdown(tmp_path):
    proc = _run(
        tmp_path,
        "--device",
        "cpu",
        "--tiny",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--compile-backend",
        "aot_eager",
        "--peak-tflops",
        "0.5",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "res" / "gpu_throughput.json").read_text())
    contenders = result["summary"]["contenders"]
    assert list(contenders) == [
        "plain",
        "mm_fsdp2",
        "plain_compiled",
        "mm_fsdp2_compiled",
        "mm_hf",  # the Transformers Llama of the same shape, and with ring (KV all-gather) CP 2 on 2 ranks
        "mm_hf_ring_cp2",
    ]
    hf = [contenders.pop(name) for name in ("mm_hf", "mm_hf_ring_cp2")]
    assert all(c["final_loss"] == c["final_loss"] and c["final_loss"] > 0 for c in hf)
    assert [c["seq"] for c in hf] == [16, 32]  # the pair shares sequences twice as long
    assert hf[1]["flops_per_token"] > hf[0]["flops_per_token"]  # more attention per token
    assert "ratio_ring_cp2_to_hf" in result["summary"]
    losses = [c["final_loss"] for c in contenders.values()]
    assert all(loss == loss and loss > 0 for loss in losses)  # finite and positive
    # Same model, data and optimiser: every contender ends at the same loss (bf16 compute, aot_eager graphs).
    assert max(losses) - min(losses) < 1e-2 * max(losses)
    # MFU through the project's FLOP counter (the one MMLightningModule logs with), against the peak given
    from transformers import LlamaConfig

    from lightning_mm.hf.transformers_flops import FlopCounter

    tiny = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    assert (
        result["summary"]["flops_per_step_per_gpu"] == FlopCounter(tiny)({"input_ids": torch.ones(2, 16).long()}).model
    )
    for c in contenders.values():
        assert c["tflops_per_gpu"] * 1e12 == pytest.approx(
            c["tokens_per_s_per_gpu"] * result["summary"]["flops_per_token"]
        )
        assert c["mfu"] == pytest.approx(c["tflops_per_gpu"] / 0.5)
    rows = (tmp_path / "res" / "gpu_throughput.md").read_text()
    assert "| mm_fsdp2_compiled |" in rows and "compile_speedup_mm" in rows
