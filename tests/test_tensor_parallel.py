"""Tensor parallelism (issue #39): TP 2 x FSDP2 2 on 4 gloo ranks trains a tiny real Qwen3 as one-process plain
Transformers does (the harness of ``tests/helpers/parity.py``), gradient clipping on; and what is refused before
compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.core.plan import build_plan, describe_rank_shapes, rank_shapes
from tests.helpers.parity import (
    TP_CASES,
    TP_RESUME,
    global_losses,
    global_steps,
    reference_run,
    relative_errors,
    weight_errors,
)
from tests.helpers.scenario_kit import run
from tests.scenarios import parity_scenarios
from tests.scenarios.hf_scenarios import FAMILIES, VOCAB, save_tiny_checkpoints
from tests.test_parity import FP32_LOSS, _part, _ranks

# Final weights within relative 1e-5 per tensor (measured: 3e-6): 6 steps, too few for AdamW to amplify the rounding
# of near-cancelling gradient elements as it does over the longer 2-rank parity cases (test_parity.FP32_WEIGHTS).
TP_WEIGHTS = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    ckpts = tmp_path_factory.mktemp("tp_ckpts")
    save_tiny_checkpoints(ckpts, ["qwen3"])
    out = tmp_path_factory.mktemp("tp_train")
    run(parity_scenarios.tensor_parallel, out, args={"ckptdir": ckpts}, timeout=900)
    return out, ckpts


def test_tp2_fsdp2_trains_as_plain_transformers(trained):
    out, ckpts = trained
    case = TP_CASES[0]
    ranks = _ranks(out, case.name, 4)
    # TP ranks (0, 1) and (2, 3) read the same samples; the two data-parallel groups different ones.
    indices = [r["parts"][0]["indices"] for r in ranks]
    assert indices[0] == indices[1] and indices[2] == indices[3] and indices[0] != indices[2]
    layout = ranks[0]["parts"][0]["layout"]
    # 2-D DTensors on (shard, tp): q_proj's rows split over tp then over FSDP2's shard dimension, o_proj's columns
    # over tp and its rows over shard.
    assert layout["q_proj"][0] == layout["o_proj"][0] == ["shard", "tp"]
    assert layout["q_proj"][2] == [8, 32] and layout["o_proj"][2] == [16, 16]
    part = _part(ranks, 0)
    steps = global_steps(case, part)
    ref = reference_run(case, steps, ckpts / case.family)
    errors = relative_errors(global_losses(part), ref.losses)
    assert max(errors) <= FP32_LOSS, f"losses {global_losses(part)} against {ref.losses}: {errors}"
    norms = part[0]["norms"]
    assert max(relative_errors(norms, ref.norms)) <= FP32_LOSS, (norms, ref.norms)
    assert min(ref.norms) > case.clip, "every step should clip"
    final = torch.load(out / f"{case.name}.pt", weights_only=True)
    worst = sorted(weight_errors(final, ref).items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= TP_WEIGHTS, f"final weights differ from the reference: {worst}"


def test_checkpoint_saved_at_tp2_resumes_at_tp1_exactly(trained):
    """DCP reshards the 2-D (shard, tp) model and optimiser state into the 1-D FSDP2 layout of 4 ranks."""
    out, ckpts = trained
    case = TP_RESUME
    ranks = _ranks(out, case.name, 4)
    first, second = _part(ranks, 0), _part(ranks, 1)
    steps = global_steps(case, first) + global_steps(case, second)
    assert len(global_steps(case, first)) == case.resume_at and len(steps) == case.steps
    assert first[0]["layout"]["q_proj"][0] == ["shard", "tp"] and second[0]["layout"]["q_proj"][0] == ["shard"]
    assert first[0]["indices"] == first[1]["indices"] != first[2]["indices"]  # TP 2: ranks 0 and 1 share samples
    assert all(len(s[0]) == 4 and sum(len(i) for i in s[0]) == 8 for s in global_steps(case, first))
    assert len({tuple(i) for i in second[0]["indices"][:1] + second[1]["indices"][:1]}) == 2  # 4 data ranks
    ref = reference_run(case, steps, ckpts / case.family)
    errors = relative_errors(global_losses(first) + global_losses(second), ref.losses)
    assert max(errors) <= FP32_LOSS, errors
    final = torch.load(out / f"{case.name}.pt", weights_only=True)
    worst = sorted(weight_errors(final, ref).items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= TP_WEIGHTS, f"final weights differ from the reference: {worst}"


def test_hf_export_of_the_tp2_checkpoint_equals_the_unsharded_weights(trained, tmp_path):
    """``lightning-mm convert dcp-to-hf`` (one process) of the DCP checkpoint saved at TP 2 x FSDP 2 (2-D DTensors)
    writes the weights the one-process reference has after the same steps, under Transformers' names."""
    from safetensors.torch import load_file

    from lightning_mm.commands.convert import main as convert_main

    out, ckpts = trained
    case = TP_RESUME
    first = _part(_ranks(out, case.name, 4), 0)
    assert first[0]["layout"]["q_proj"][0] == ["shard", "tp"]
    assert convert_main(["dcp-to-hf", str(out / f"{case.name}.ckpt"), str(tmp_path / "hf")]) in (0, None)
    exported: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_file(shard))
    ref = reference_run(case, global_steps(case, first), ckpts / case.family)
    assert set(exported) <= set(ref.final), sorted(set(exported) - set(ref.final))[:5]
    worst = sorted(weight_errors(exported, ref).items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= TP_WEIGHTS, f"exported weights differ from the reference: {worst}"


def _qwen3(**overrides) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        return Qwen3ForCausalLM(Qwen3Config(**{**FAMILIES["qwen3"][1], **overrides}))


def test_plan_takes_the_models_own_tp_plan():
    plan = build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=2), _qwen3(), 4)
    styles = dict(plan.tp_plan)
    assert styles["model.layers.1.self_attn.q_proj"] == "colwise"
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert styles["model.layers.0.self_attn.k_norm"] == "replicated_with_grad_allreduce"
    assert "lm_head" not in styles and plan.mesh_dim_names == ("shard", "tp") and plan.sharding_size == 2
    assert "tensor parallel (18 modules" in plan.describe()


def test_per_rank_shapes():
    model = _qwen3()
    plan = build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=2), model, 4)
    shapes = {key: (whole, local) for key, whole, local in rank_shapes(model, plan)}
    assert shapes["model.layers.*.self_attn.q_proj.weight"] == ((32, 32), (8, 32))  # rows / tp 2, then / shard 2
    assert shapes["model.layers.*.self_attn.o_proj.weight"] == ((32, 32), (16, 16))  # columns / tp 2, rows / 2
    assert shapes["model.layers.*.mlp.down_proj.weight"] == ((32, 64), (16, 32))
    assert shapes["lm_head.weight"] == ((VOCAB, 32), (-(-VOCAB // 2), 32))  # replicated over tp
    assert "tp=2" in describe_rank_shapes(model, plan)


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        (
            {"tp_plan": {"model.layers.*.mlp.nothing": "colwise"}},
            r"`tp_plan`: 'model.layers.\*.mlp.nothing': matches no",
        ),
        ({"tp_plan": {"model.layers.*.input_layernorm": "colwise"}}, "is a Qwen3RMSNorm, not an nn.Linear"),
        ({"recompute_modules": ["model.layers.{*}"]}, "`recompute_modules`: not supported with tensor_parallel_size"),
        ({"expert_parallel_size": 2}, "`expert_parallel_size`: 2 with tensor_parallel_size 2 is not supported"),
    ],
)
def test_refused_before_compute(keys, match):
    with pytest.raises(FSDP2ConfigError, match=match):
        build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=2, **keys), _qwen3(), 4)


def test_refuses_heads_that_do_not_divide():
    with pytest.raises(FSDP2ConfigError, match="`tensor_parallel_size`: 4 does not divide .*num_key_value_heads 2"):
        build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=4), _qwen3(), 4)


def test_refuses_a_fused_projection():
    model = _qwen3()
    attn = model.model.layers[0].self_attn
    attn.qkv_proj = torch.nn.Linear(32, 96, bias=False, device="meta")
    config = FSDP2Config(
        sharding_size="auto", tensor_parallel_size=2, tp_plan={"model.layers.0.self_attn.qkv_proj": "colwise"}
    )
    with pytest.raises(FSDP2ConfigError, match="fused projection"):
        build_plan(config, model, 4)


def test_refuses_the_chunked_loss():
    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.hf.chunk_loss import enable_chunk_loss
    from lightning_mm.strategies.precision import MMFSDP2Precision

    model = _qwen3()
    enable_chunk_loss(model, 16)
    strategy = MMFSDP2Strategy({"sharding_size": "auto", "tensor_parallel_size": 2})
    strategy.precision_plugin = MMFSDP2Precision("32-true")
    with pytest.raises(FSDP2ConfigError, match="`tensor_parallel_size`: 2 with the chunked loss"):
        strategy.plan_for(model, 4)


def test_refuses_lora_adapters():
    model = _qwen3()
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.register_parameter("lora_A", torch.nn.Parameter(torch.empty(2, 32, device="meta")))
    with pytest.raises(FSDP2ConfigError, match="`tensor_parallel_size`: 2 with LoRA adapters"):
        build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=2), model, 4)
