"""Expert parallelism and aligned parameter groups on 4 CPU ranks against one-process Transformers (issue #15).

One launch (``tests/ep_scenarios.py``) trains every case of ``EP_CASES`` with ``Trainer(devices=4)`` and real gloo
collectives; the references are plain Transformers models trained here with the same AdamW over the same global
batches (``tests/parity.py``). fp32: relative 1e-5 per micro-batch loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ep_scenarios import DEVICES, EP_CASES
from tests.moe_models import register_moe_families, save_moe_checkpoints
from tests.parity import global_losses, global_steps, reference_run, relative_errors

ROOT = Path(__file__).resolve().parents[1]
FP32_LOSS = 1e-5
CASES = {c.name: c for c in EP_CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    register_moe_families()
    ckpts = tmp_path_factory.mktemp("moe_ckpts")
    save_moe_checkpoints(ckpts)
    out = tmp_path_factory.mktemp("ep_runs")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    env.pop("EP_ONLY", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "ep_scenarios.py"), "train", str(out), str(ckpts)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"EP scenarios failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return out, ckpts


def _ranks(out: Path, name: str) -> list[dict[str, Any]]:
    ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(DEVICES)]
    for r, data in enumerate(ranks):
        assert data["error"] is None, f"rank {r} of {name} failed:\n{data['error']}"
    return ranks


@pytest.mark.parametrize("name", list(CASES))
def test_losses_equal_transformers(runs, name):
    out, ckpts = runs
    case = CASES[name]
    ranks = [r["parts"][0] for r in _ranks(out, name)]
    steps = global_steps(case, ranks)
    assert len(steps) == case.steps and all(len(group) == DEVICES for micro in steps for group in micro)
    ref = reference_run(case, steps, ckpts / case.family)
    errors = relative_errors(global_losses(ranks), ref.losses)
    assert max(errors) < FP32_LOSS, f"{name}: per-step relative loss errors {errors}"


def test_aligned_unit_holds_exactly_the_norms_and_routers(runs):
    out, _ = runs
    aligned = _ranks(out, "qwen3_moe-align")[0]["parts"][0]["aligned"]
    expected = sorted(
        [f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("input_layernorm", "post_attention_layernorm",
                                                                      "self_attn.q_norm", "self_attn.k_norm",
                                                                      "mlp.gate")]
        + ["model.norm.weight"]
    )
    assert aligned == expected
