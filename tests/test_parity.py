"""Numerical parity with plain Transformers + torch (issue #11): the harness of ``tests/helpers/parity.py``.

Three launches: every training case on 2 ranks (``train``), checkpoint and resume on 2 ranks (``resume``), and
the resumed run on 1 process (``resume_one``). Dense Qwen3-VL runs in the first two: reentrant recomputation with
a trainable tower, non-reentrant with a frozen (ignored) tower, and a resume. The references are computed here,
in this process (plain models, no torch.distributed). Tolerance for fp32: relative 1e-5 per micro-batch loss and
per final weight tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.parity import (
    CASES,
    QWEN3_VL,
    RECOMPUTE,
    TORCH_LAYERS,
    TRAIN_CASES,
    Case,
    global_losses,
    global_steps,
    noise_fraction,
    reference_run,
    relative_errors,
    weight_errors,
)
from tests.helpers.qwen3_vl_family import save_qwen3_vl
from tests.helpers.scenario_kit import run
from tests.scenarios import parity_scenarios
from tests.scenarios.hf_scenarios import save_tiny_checkpoints

ROOT = Path(__file__).resolve().parents[1]
FP32_LOSS = 1e-5
# AdamW divides each gradient element by its running RMS: where an element is a near-cancellation of much larger
# terms (a key bias under rotary embeddings), fp32 rounding of those terms becomes a visible share of the step.
# After 6 steps the worst tensor (Qwen2's k_proj.bias) is 7e-5 away, the others below 1e-6. Elements whose
# gradient is pure rounding noise (parity.NOISE) are left out; they must stay a small share (NOISE_SHARE).
FP32_WEIGHTS = 3e-4
NOISE_SHARE = 1e-2
# bf16 (bf16 parameters, fp32 reduction): both sides round the same fp32 master weights to bf16, run the same
# bf16 kernels on the same inputs, take each rank's gradients in bf16, average them in fp32 (for two ranks a sum
# and a halving, both exact) and step AdamW on fp32 masters, so they agree to fp32 rounding (measured: equal
# losses, weights 1e-8 apart). The tolerances leave room for a reduction ordered differently by another build
# (one bf16 rounding step, 2^-8, in one value moves the loss by far less than 1e-4) and stay well below what
# computing in bf16 does (against an fp32 run: losses 6e-4 and weights 6e-2 apart; checked below).
BF16_LOSS, BF16_WEIGHTS = 1e-4, 1e-3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("parity_ckpts")
    save_tiny_checkpoints(directory, [f for f in RECOMPUTE if f != QWEN3_VL])
    save_qwen3_vl(directory / QWEN3_VL)
    return directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ckpts) -> Path:
    out = tmp_path_factory.mktemp("parity_train")
    run(parity_scenarios.train, out, args={"ckptdir": ckpts}, timeout=900)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, ckpts) -> Path:
    out = tmp_path_factory.mktemp("parity_resume")
    run(parity_scenarios.resume, out, args={"ckptdir": ckpts}, timeout=900)
    run(parity_scenarios.resume_one, out, args={"ckptdir": ckpts}, timeout=900)
    return out


def _ranks(out: Path, name: str, n: int = 2) -> list[dict[str, Any]]:
    ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(n)]
    errors = [r["error"] for r in ranks if r["error"]]
    if errors:
        pytest.fail(f"{name} failed on the strategy's side:\n{errors[0]}")
    return ranks


def _part(ranks: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    return [r["parts"][i] for r in ranks]


def _check(
    case: Case,
    losses: list[float],
    final: dict[str, torch.Tensor],
    steps: list,
    ckpts: Path,
    initial: dict[str, torch.Tensor] | None = None,
    first: int = 0,
) -> None:
    ref = reference_run(case, steps, ckpts / case.family, initial)
    loss_tol, weight_tol = (BF16_LOSS, BF16_WEIGHTS) if case.precision == "bf16-mixed" else (FP32_LOSS, FP32_WEIGHTS)
    errors = relative_errors(losses, ref.losses[first:])
    assert max(errors) <= loss_tol, f"losses {losses} against {ref.losses[first:]}: relative errors {errors}"
    worst = sorted(weight_errors(final, ref).items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= weight_tol, f"final weights differ from the reference: {worst}"
    assert noise_fraction(ref) <= NOISE_SHARE, sorted(ref.noise)


@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda c: c.name)
def test_training_matches_plain_transformers_and_torch(trained, ckpts, case):
    ranks = _ranks(trained, case.name)
    assert ranks[0]["parts"][0]["indices"] != ranks[1]["parts"][0]["indices"], "ranks should see distinct samples"
    part = _part(ranks, 0)
    initial = torch.load(trained / f"{case.name}.init.pt", weights_only=True) if case.family == TORCH_LAYERS else None
    final = torch.load(trained / f"{case.name}.pt", weights_only=True)
    _check(case, global_losses(part), final, global_steps(case, part), ckpts, initial)


def test_torch_layers_are_initialised_like_their_constructors(trained):
    """nn.TransformerEncoder's layers start as copies of one layer; MultiheadAttention zeroes its biases."""
    initial = torch.load(trained / "torch_layers-recompute.init.pt", weights_only=True)
    layer0 = {k.removeprefix("encoder.layers.0."): v for k, v in initial.items() if k.startswith("encoder.layers.0.")}
    layer1 = {k.removeprefix("encoder.layers.1."): v for k, v in initial.items() if k.startswith("encoder.layers.1.")}
    assert layer0.keys() == layer1.keys() and all(torch.equal(layer0[k], layer1[k]) for k in layer0)
    assert torch.all(layer0["self_attn.in_proj_bias"] == 0) and torch.all(layer0["self_attn.out_proj.bias"] == 0)
    assert torch.all(layer0["norm1.weight"] == 1) and torch.all(layer0["norm1.bias"] == 0)
    in_proj = layer0["self_attn.in_proj_weight"]  # xavier_uniform_: U(-a, a), a = sqrt(6 / (fan_in + fan_out))
    bound = (6 / sum(in_proj.shape)) ** 0.5
    assert in_proj.abs().max() <= bound and in_proj.std() == pytest.approx(bound / 3**0.5, rel=0.1)


def test_bf16_tolerance_is_tight_enough_to_tell_bf16_from_fp32(trained, ckpts):
    """The bf16 case's tolerances reject what computing in fp32 instead would give."""
    case = CASES["llama_tied-bf16"]
    part = _part(_ranks(trained, case.name), 0)
    fp32 = reference_run(Case("fp32", case.family), global_steps(case, part), ckpts / case.family)
    final = torch.load(trained / f"{case.name}.pt", weights_only=True)
    assert max(relative_errors(global_losses(part), fp32.losses)) > 3 * BF16_LOSS
    assert max(weight_errors(final, fp32).values()) > 3 * BF16_WEIGHTS


def _resume_check(resumed: Path, ckpts: Path, name: str) -> None:
    case = CASES[name]
    ranks = _ranks(resumed, name)
    first, second = _part(ranks, 0), _part(ranks, 1)
    steps = global_steps(case, first) + global_steps(case, second)
    assert len(steps) == case.steps and len(global_steps(case, first)) == case.resume_at
    final = torch.load(resumed / f"{name}.pt", weights_only=True)
    _check(case, global_losses(first) + global_losses(second), final, steps, ckpts)


def test_resume_continues_exactly(resumed, ckpts):
    _resume_check(resumed, ckpts, "qwen3-resume")


def test_resume_with_a_trainable_vision_tower_continues_exactly(resumed, ckpts):
    _resume_check(resumed, ckpts, "llava-trainable-tower-resume")


def test_resume_qwen3_vl_continues_exactly(resumed, ckpts):
    """Dense Qwen3-VL (two images per sample, M-RoPE positions from mm_token_type_ids), tower trainable."""
    _resume_check(resumed, ckpts, "qwen3_vl-resume")


def test_resume_on_one_rank_continues_exactly(resumed, ckpts):
    """The 2-rank checkpoint of step 3 resumed by one process: the same global batches, the same numbers."""
    case = CASES["qwen3-resume"]
    first = _part(_ranks(resumed, case.name), 0)
    second = _part(_ranks(resumed, f"{case.name}-one-rank", n=1), 0)
    assert all(len(ix) == 4 for ix in second[0]["indices"])  # one rank takes the whole global batch
    steps = global_steps(case, first) + global_steps(case, second)
    final = torch.load(resumed / f"{case.name}-one-rank.pt", weights_only=True)
    _check(case, global_losses(second), final, steps, ckpts, first=case.resume_at)
