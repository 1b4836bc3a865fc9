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
import torch

from tests.ep_scenarios import DEVICES, EP_CASES, RESUME
from tests.moe_models import register_moe_families, save_moe_checkpoints
from tests.parity import global_losses, global_steps, reference_run, relative_errors, weight_errors

ROOT = Path(__file__).resolve().parents[1]
FP32_LOSS = 1e-5
FP32_WEIGHTS = 3e-4  # as in tests/test_parity.py (AdamW amplifies fp32 rounding in near-cancelling elements)
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


def test_ep2_checkpoint_resumes_without_ep_exactly(runs):
    out, ckpts = runs
    case = RESUME
    ranks = _ranks(out, case.name)
    first, second = [r["parts"][0] for r in ranks], [r["parts"][1] for r in ranks]
    steps = global_steps(case, first) + global_steps(case, second)
    assert len(global_steps(case, first)) == case.resume_at and len(steps) == case.steps
    ref = reference_run(case, steps, ckpts / case.family)
    errors = relative_errors(global_losses(first) + global_losses(second), ref.losses)
    assert max(errors) < FP32_LOSS, f"per-step relative loss errors {errors}"
    final = torch.load(out / f"{case.name}.pt", weights_only=True)
    worst = max(weight_errors(final, ref).items(), key=lambda kv: kv[1])
    assert worst[1] <= FP32_WEIGHTS, f"final weights differ from the reference: {worst}"


def test_ep2_checkpoint_converts_to_transformers_layout(runs, tmp_path):
    import transformers

    from lightning_mm.strategies.checkpoint.convert import dcp_to_hf

    out, ckpts = runs
    case = RESUME
    hf_dir = dcp_to_hf(out / f"{case.name}.ckpt", tmp_path / "hf")
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    first = [r["parts"][0] for r in _ranks(out, case.name)]
    ref = reference_run(case, global_steps(case, first), ckpts / case.family)  # the 3 steps before the save
    state = dict(model.named_parameters())
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # all experts, fused as Transformers has
    errors = {n: float((state[n].detach() - t).norm() / t.norm()) for n, t in ref.final.items()}
    worst = max(errors.items(), key=lambda kv: kv[1])
    assert worst[1] <= FP32_WEIGHTS, f"converted weights differ from the reference after 3 steps: {worst}"


def test_rank_whose_experts_get_no_token_takes_part_in_backward(runs):
    """No token routed to the last rank's experts: the launch finishes (it deadlocked) and results are exact."""
    from tests.ep_scenarios import IDLE_RANK

    ranks = [r["parts"][0] for r in _ranks(runs[0], IDLE_RANK.name)]
    for r, data in enumerate(ranks):
        assert data["out"] < 1e-6 and data["x_grad"] < 1e-6 and data["w_grad"] < 1e-6, (r, data)
        assert data["expert_grads"] < 1e-5, (r, data)
    assert ranks[-1]["idle_expert_grads"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# A custom MoE model's own dispatch (FSDP2Mixin.expert_parallel_forward) and a training step in which some ranks'
# experts receive no token (tests/ep_custom_scenarios.py; same launch).
@pytest.mark.parametrize("name", ["custom_moe-ep2", "custom_moe-ep2-whole"])
def test_custom_moe_dispatch_hook_trains_as_one_process_without_ep(runs, name):
    from tests.ep_custom_scenarios import CUSTOM_CASES, LAYERS, custom_reference

    case = {c.name: c for c in CUSTOM_CASES}[name]
    ranks = [r["parts"][0] for r in _ranks(runs[0], name)]
    for data in ranks:  # the hook served every MoE module, each rank holding half of the 4 experts
        assert data["hook_calls"] == [f"blocks.{i}.experts" for i in range(LAYERS)], data["hook_calls"]
        assert data["local_experts"] == [2] * LAYERS
    steps = global_steps(case, ranks)
    assert len(steps) == case.steps and all(len(group) == DEVICES for micro in steps for group in micro)
    errors = relative_errors(global_losses(ranks), custom_reference(steps))
    assert max(errors) < FP32_LOSS, f"{name}: per-step relative loss errors {errors}"


def test_training_with_ranks_whose_experts_get_no_token(runs):
    """All routers zero: every token picks the same two experts, so in the first step two of the four EP ranks
    receive no token in every MoE layer. The launch finishes (a rank skipping the all-to-all's backward
    deadlocked against FSDP's reduce-scatter) and the losses equal one-process Transformers'."""
    from tests.ep_custom_scenarios import ZERO_ROUTER

    out, _ = runs
    case = ZERO_ROUTER
    ranks = [r["parts"][0] for r in _ranks(out, case.name)]
    per_rank = 8 // 4
    for layer in range(2):
        picked = {e for data in ranks for e in data["chosen_experts"][layer]}
        idle = [r for r in range(DEVICES) if not picked & set(range(r * per_rank, (r + 1) * per_rank))]
        assert idle, f"layer {layer}: every rank's experts got tokens ({sorted(picked)}); the case tests nothing"
    steps = global_steps(case, ranks)
    assert len(steps) == case.steps
    ref = reference_run(case, steps, out / "zero_router_ckpt" / case.family)
    errors = relative_errors(global_losses(ranks), ref.losses)
    assert max(errors) < FP32_LOSS, f"per-step relative loss errors {errors}"


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("routing", ["idle", "busy"])
def test_routed_forward_with_each_transformers_experts_kernel(runs, impl, routing):
    """The routed forward and backward equal the unsplit experts module's with each of Transformers' experts
    implementations, with a rank whose experts get no token ("idle") and without ("busy")."""
    from tests.ep_custom_scenarios import ROUTED_KERNELS

    for r, data in enumerate(_ranks(runs[0], ROUTED_KERNELS.name)):
        result = data["parts"][0][f"{impl}-{routing}"]
        assert result["finite"], (r, result)
        assert result["out"] < 1e-6 and result["x_grad"] < 1e-6 and result["w_grad"] < 1e-6, (r, result)
        assert result["expert_grads"] < 1e-5, (r, result)


@pytest.mark.parametrize("name", ["qwen3_moe-hub-layout-ep2", "qwen3_moe-hub-layout-ep4-whole"])
def test_hub_layout_per_expert_weights_load_sliced_under_ep(runs, name):
    """Qwen3-MoE stored one tensor per expert (its Hub layout): each rank reads only its own experts' pieces (2 of 8
    per layer on 4 ranks, every piece read by exactly one rank), and training equals one-process Transformers'
    `from_pretrained` of the same files."""
    import re

    from tests.ep_custom_scenarios import HUB_LAYOUT_CASES

    out, _ = runs
    case = {c.name: c for c in HUB_LAYOUT_CASES}[name]
    ranks = [r["parts"][0] for r in _ranks(out, name)]
    owners: dict[tuple[int, int], int] = {}
    for r, data in enumerate(ranks):
        per_layer: dict[int, set[int]] = {}
        pieces: dict[tuple[int, int], list[str]] = {}
        for key, offsets, _sizes in data["expert_reads"]:
            found = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", key)
            assert found is not None, key
            layer, expert = int(found.group(1)), int(found.group(2))
            assert offsets == [0, 0], (key, offsets)  # whole pieces: the experts are split, not their rows
            per_layer.setdefault(layer, set()).add(expert)
            pieces.setdefault((layer, expert), []).append(found.group(3))
        assert sorted(per_layer) == [0, 1] and all(len(e) == 2 for e in per_layer.values()), (r, per_layer)
        for where, kinds in pieces.items():
            assert sorted(kinds) == ["down", "gate", "up"], (r, where, kinds)
            assert where not in owners, f"expert {where} read by ranks {owners[where]} and {r}"
            owners[where] = r
    assert sorted(owners) == [(layer, e) for layer in range(2) for e in range(8)]
    steps = global_steps(case, ranks)
    assert len(steps) == case.steps
    ref = reference_run(case, steps, out / "hub_layout_ckpt" / case.family)
    errors = relative_errors(global_losses(ranks), ref.losses)
    assert max(errors) < FP32_LOSS, f"{name}: per-step relative loss errors {errors}"
