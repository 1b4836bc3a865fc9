"""Tensor parallelism (issue #39): TP 2 x FSDP2 2 on 4 gloo ranks trains a tiny real Qwen3 as one-process plain
Transformers does (the harness of ``tests/helpers/parity.py``), gradient clipping on; and what is refused before
compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.core.sharding_plan import build_plan, describe_rank_shapes, rank_shapes
from tests.helpers.moe_models import MOE_MODULES, register_moe_families, tiny_moe_model
from tests.helpers.parity import (
    QWEN3_KV4,
    SP_PLAN,
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
from tests.scenarios.hf_scenarios import FAMILIES, SEQ, VOCAB, save_tiny_checkpoints
from tests.test_parity import FP32_LOSS, FP32_WEIGHTS, _part, _ranks

# Final weights within relative 1e-5 per tensor (measured: 3e-6): 6 steps, too few for AdamW to amplify the rounding
# of near-cancelling gradient elements as it does over the longer 2-rank parity cases (test_parity.FP32_WEIGHTS).
TP_WEIGHTS = 1e-5
# Qwen2.5-VL's key biases have near-cancelling gradient elements (measured 2e-5 over 6 steps): its bound of the
# 2-rank parity suite (the losses and norms still agree to 1e-5 per step).
# Qwen3-MoE's: that of the expert-parallel suite (tests/test_expert_parallel.py); LoRA's adapters (B starts at zero,
# so AdamW's first steps are sign-like on small gradients) measured 4.5e-5.
# TP 2 x CP 2 by Ulysses (two all-to-alls per attention, sums in another order): measured 1.7e-5 (its losses and
# norms agree to 1e-5 per step).
WEIGHTS = {
    "qwen2_5_vl": FP32_WEIGHTS,
    "qwen3_moe": FP32_WEIGHTS,
    "qwen3-tp2-lora-recompute": FP32_WEIGHTS,
    "qwen3_kv4-tp2-cp2-ulysses": FP32_WEIGHTS,
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    ckpts = tmp_path_factory.mktemp("tp_ckpts")
    save_tiny_checkpoints(ckpts, ["qwen3", "qwen2_5_vl"])
    register_moe_families()
    tiny_moe_model("qwen3_moe", seed=10).save_pretrained(ckpts / "qwen3_moe")
    torch.manual_seed(1)
    Qwen3ForCausalLM(Qwen3Config(**QWEN3_KV4)).save_pretrained(ckpts / TP_RESUME.family)
    out = tmp_path_factory.mktemp("tp_train")
    run(parity_scenarios.tensor_parallel, out, args={"ckptdir": ckpts}, timeout=900)
    return out, ckpts


@pytest.mark.parametrize("case", TP_CASES, ids=[c.name for c in TP_CASES])
def test_tp2_fsdp2_trains_as_plain_transformers(trained, case):
    """Qwen3, and Qwen2.5-VL (its language model split by its text config's ``base_model_tp_plan``, the vision
    tower replicated over ``tp`` and sharded by FSDP2 over the data-parallel ranks only)."""
    out, ckpts = trained
    ranks = _ranks(out, case.name, 4)
    # TP ranks (0, 1) and (2, 3) read the same samples; the two data-parallel groups different ones.
    indices = [r["parts"][0]["indices"] for r in ranks]
    cp = case.fsdp2.get("context_parallel_size", 1)
    if cp > 1:  # TP 2 x CP 2: one data-parallel group, all 4 ranks read the same samples
        assert indices[0] == indices[1] == indices[2] == indices[3]
    else:
        assert indices[0] == indices[1] and indices[2] == indices[3] and indices[0] != indices[2]
    layout = ranks[0]["parts"][0]["layout"]
    # 2-D DTensors on (shard, tp): q_proj's rows split over tp then over FSDP2's shard dimension, o_proj's columns
    # over tp and its rows over shard.
    assert layout["q_proj"][0] == layout["o_proj"][0] == ["shard", "tp"]
    assert layout["q_proj"][2] == [8, 32] and layout["o_proj"][2] == [16, 16]
    if "vision_qkv" in layout:  # replicated over tp: only FSDP2's shard dimension, half of 96 rows
        assert layout["vision_qkv"][0] == ["shard"] and layout["vision_qkv"][2] == [48, 32]
    if case.model.get("enable_chunk_loss"):  # column-parallel output layer: 128 vocabulary rows / tp 2 / shard 2
        assert layout["lm_head"][0] == ["shard", "tp"] and layout["lm_head"][2] == [VOCAB // 4, 32]
    else:  # replicated over tp: sharded by FSDP2 alone
        assert layout["lm_head"][0] == ["shard"]
    if "experts" in layout:  # 4 of 8 experts per EP rank, sharded by FSDP2 over ep_replicate: 2 rows each
        assert layout["experts"][0] == ["ep_replicate"] and layout["experts"][2][0] == 2
    # Sequence parallelism: the decoder layers' norms see half of each 16-token sequence; otherwise all of it.
    sp = "sequence_parallel" in (case.fsdp2.get("tp_plan") or {}).values()
    # compile_modules: both decoder layers' forwards are the compiled ones (and only they).
    compiled = ranks[0]["parts"][0]["compiled"]
    assert [c.rsplit("model.", 1)[-1] for c in compiled] == (
        ["layers.0", "layers.1"] if case.fsdp2.get("compile_modules") else []
    )
    # Context parallelism: each rank of a CP group holds half of each sequence.
    assert ranks[0]["parts"][0]["norm_sequence"] == ([SEQ // 2] if sp or cp > 1 else [SEQ])
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
    assert worst[0][1] <= WEIGHTS.get(case.name, WEIGHTS.get(case.family, TP_WEIGHTS)), (
        f"final weights differ from the reference: {worst}"
    )


def test_vocab_parallel_cross_entropy_equals_torchs(trained):
    """The chunked loss's vocabulary-parallel cross-entropy on the 2 gloo ranks of each TP group (half of the
    vocabulary each, ``-100`` targets among them) equals ``torch.nn.functional.cross_entropy`` of the whole logits:
    the loss, the hidden states' gradient (all-reduced) and each rank's rows of the weight and bias gradients."""
    out, _ = trained
    ranks = [r["parts"][0] for r in _ranks(out, "vocab-parallel-ce", 4)]
    assert all(0 < r["owned"] for r in ranks)  # each rank owns some of the targets
    for rank in ranks:
        assert max(rank["errors"].values()) <= FP32_LOSS, rank["errors"]


@pytest.mark.parametrize(("tp", "part"), [(1, 1), (4, 2)])
def test_checkpoint_saved_at_tp2_resumes_at_another_tp_exactly(trained, tp, part):
    """DCP reshards the 2-D (shard, tp) model and optimiser state saved at TP 2 x FSDP2 2 into the 1-D FSDP2 layout
    of 4 ranks (TP 1), and into TP 4 x FSDP2 1 (every weight split 4 ways, one data-parallel group)."""
    out, ckpts = trained
    case = TP_RESUME
    ranks = _ranks(out, case.name, 4)
    first, second = _part(ranks, 0), _part(ranks, part)
    steps = global_steps(case, first) + global_steps(case, second)
    assert len(global_steps(case, first)) == case.resume_at and len(steps) == case.steps
    assert first[0]["layout"]["q_proj"][0] == ["shard", "tp"]
    assert first[0]["indices"] == first[1]["indices"] != first[2]["indices"]  # TP 2: ranks 0 and 1 share samples
    assert all(len(s[0]) == 4 and sum(len(i) for i in s[0]) == 8 for s in global_steps(case, first))
    if tp == 1:
        assert second[0]["layout"]["q_proj"][0] == ["shard"]
        assert len({tuple(i) for i in second[0]["indices"][:1] + second[1]["indices"][:1]}) == 2  # 4 data ranks
    else:  # q_proj's 32 rows over tp 4, o_proj's 32 columns over tp 4; FSDP2's shard dimension of size 1
        assert second[0]["layout"]["q_proj"][0] == ["shard", "tp"] and second[0]["layout"]["q_proj"][2] == [8, 32]
        assert second[0]["layout"]["o_proj"][2] == [32, 8]
        assert all(r["indices"] == second[0]["indices"] for r in second)  # one group: every rank the same samples
    ref = reference_run(case, steps, ckpts / case.family)
    errors = relative_errors(global_losses(first) + global_losses(second), ref.losses)
    assert max(errors) <= FP32_LOSS, errors
    norms = first[0]["norms"] + second[0]["norms"]
    assert max(relative_errors(norms, ref.norms)) <= FP32_LOSS, (norms, ref.norms)
    final = torch.load(out / f"{case.name}.tp{tp}.pt", weights_only=True)
    worst = sorted(weight_errors(final, ref).items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= TP_WEIGHTS, f"final weights differ from the reference: {worst}"


def test_hf_export_of_the_tp2_checkpoint_equals_the_unsharded_weights(trained, tmp_path):
    """``lightning-mm convert dcp-to-hf`` (one process) of the DCP checkpoint saved at TP 2 x FSDP 2 (2-D DTensors)
    writes the weights the one-process reference has after the same steps, under Transformers' names."""
    from safetensors.torch import load_file

    from lightning_mm.commands.convert_command import main as convert_main

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


@pytest.mark.parametrize("tp", [2, 4])
def test_lightning_model_parallel_tensor_parallel_tests_adapted(trained, tp):
    """Lightning's ``test_tensor_parallel`` (``tp`` 4: one data-parallel group) and ``test_fsdp2_tensor_parallel``
    (``tp`` 2 x FSDP2 2) of ``tests/tests_pytorch/strategies/test_model_parallel_integration.py``: every weight and
    every optimiser parameter a non-meta DTensor on the 2-D (shard, tp) mesh; the data split over the data-parallel
    ranks only (its sampler, its length); the ranks of a TP group get identical batches, the data-parallel ranks
    different ones."""
    out, _ = trained
    seen = [r["parts"][0] for r in _ranks(out, f"lightning-tp{tp}", 4)]
    dp = 4 // tp
    for rank in seen:
        assert rank["params_dtensor"] and rank["optimizer_dtensor"] and rank["not_meta"]
        assert rank["w1_mesh"] == [["shard", "tp"], [dp, tp]]
        assert rank["w3_placements"][1] == "S(1)"  # row-parallel: its input columns over tp
        assert rank["sampler"] == ["DistributedSampler", dp] and rank["batches"] == 8 // 2 // dp
    for step in seen[0]["gathered"]:
        groups = [step[g * tp : (g + 1) * tp] for g in range(dp)]
        assert all(batch == group[0] for group in groups for batch in group)  # identical within a TP group
        assert len({str(group[0]) for group in groups}) == dp  # different across the data-parallel ranks


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
        ({"tp_plan": {"lm_head": "colwise"}}, r"'lm_head' is the model's output layer: .* `enable_chunk_loss`"),
        ({"ignored_modules": ["model.layers.0"]}, "`ignored_modules`: not supported with tensor_parallel_size"),
    ],
)
def test_refused_before_compute(keys, match):
    with pytest.raises(FSDP2ConfigError, match=match):
        build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=2, **keys), _qwen3(), 4)


def test_plan_with_expert_parallelism_leaves_the_experts_to_it():
    """Qwen3-MoE's own plan names its experts (``packed_colwise``, ``moe_tp_experts``) and dense MLP layers it does
    not have: with EP the expert entries are left out (EP splits them), the absent dense layers skipped."""
    config = FSDP2Config(
        sharding_size="auto", tensor_parallel_size=2, expert_parallel_size=2, moe_modules=[MOE_MODULES["qwen3_moe"]]
    )
    plan = build_plan(config, tiny_moe_model("qwen3_moe"), 4)
    styles = dict(plan.tp_plan)
    assert styles["model.layers.1.self_attn.o_proj"] == "rowwise" and len(styles) == 12
    assert not [path for path in styles if ".mlp." in path]
    assert plan.experts is not None and plan.experts.experts_per_rank == 4


def test_refuses_moe_experts_without_expert_parallelism():
    with pytest.raises(
        FSDP2ConfigError, match="`tensor_parallel_size`: Qwen3MoeForCausalLM's base_model_tp_plan .*packed_colwise"
    ):
        build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=2), tiny_moe_model("qwen3_moe"), 4)


def test_sequence_parallel_plan_opens_and_closes_the_region():
    config = FSDP2Config(sharding_size="auto", tensor_parallel_size=2, tp_plan=SP_PLAN)
    styles = dict(build_plan(config, _qwen3(), 4).tp_plan)
    assert styles["model.layers.0.input_layernorm"] == styles["model.layers.1.post_attention_layernorm"]
    assert (
        styles["model.layers.0"] == "sequence_parallel_enter" and styles["model.layers.1"] == "sequence_parallel_exit"
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model.norm": "sequence_parallel"}, "'model.norm' is not inside a decoder layer"),
        (
            {"model.layers.*.post_attention_layernorm": None},
            "'model.layers.0.post_attention_layernorm' holds parameters but has no plan entry",
        ),
    ],
)
def test_refuses_an_incomplete_sequence_parallel_plan(change, match):
    plan = {k: v for k, v in {**SP_PLAN, **change}.items() if v is not None}
    config = FSDP2Config(sharding_size="auto", tensor_parallel_size=2, tp_plan=plan)
    with pytest.raises(FSDP2ConfigError, match=match):
        build_plan(config, _qwen3(), 4)


def test_refuses_sequence_parallelism_with_experts_or_lora():
    """Under sequence parallelism each TP rank holds other tokens: a router or adapter replicated over the ranks
    would see only its rank's tokens."""
    experts = FSDP2Config(
        sharding_size="auto",
        tensor_parallel_size=2,
        expert_parallel_size=2,
        moe_modules=[MOE_MODULES["qwen3_moe"]],
        tp_plan={k: v for k, v in SP_PLAN.items() if ".mlp." not in k},
    )
    with pytest.raises(FSDP2ConfigError, match=r"sequence_parallel: 'model.layers.0.mlp.experts' holds parameters"):
        build_plan(experts, tiny_moe_model("qwen3_moe"), 4)
    lora = FSDP2Config(sharding_size="auto", tensor_parallel_size=2, tp_plan=SP_PLAN)
    with pytest.raises(FSDP2ConfigError, match=r"sequence_parallel: '.*q_proj.lora_A.default' is a LoRA adapter"):
        build_plan(lora, _lora_qwen3(), 4)


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


def _chunked_qwen3(**overrides) -> Qwen3ForCausalLM:
    from lightning_mm.hf.chunk_loss import enable_chunk_loss

    model = _qwen3(**overrides)
    enable_chunk_loss(model, 16)
    return model


def test_chunked_loss_makes_the_output_layer_column_parallel():
    """With the chunked loss the output layer is split by vocabulary rows over tp (the strategy plans it: no longer
    refused), 128 rows / tp 2 / shard 2 per rank; without it the same YAML entry is refused (above)."""
    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.strategies.precision import MMFSDP2Precision

    model = _chunked_qwen3()
    strategy = MMFSDP2Strategy({"sharding_size": "auto", "tensor_parallel_size": 2})
    strategy.precision_plugin = MMFSDP2Precision("32-true")
    plan = strategy.plan_for(model, 4).plan
    assert dict(plan.tp_plan)["lm_head"] == "colwise"
    shapes = {key: local for key, _, local in rank_shapes(model, plan)}
    assert shapes["lm_head.weight"] == (VOCAB // 4, 32)
    yaml = FSDP2Config(sharding_size="auto", tensor_parallel_size=2, tp_plan={"lm_head": "colwise"})
    assert dict(build_plan(yaml, _chunked_qwen3(), 4).tp_plan) == {"lm_head": "colwise"}


@pytest.mark.parametrize(
    ("overrides", "keys", "match"),
    [
        (
            {"tie_word_embeddings": True},
            {},
            r"`tensor_parallel_size`: the chunked loss's output layer 'lm_head' shares its weight with "
            r"'model.embed_tokens.weight' \(`tie_word_embeddings`\)",
        ),
        ({}, {"tp_plan": {"lm_head": "rowwise"}}, "'lm_head' is the output layer of the chunked loss .* not rowwise"),
        ({"vocab_size": 127}, {}, r"`tensor_parallel_size`: 2 does not divide the vocabulary \(127 rows of 'lm_head'"),
    ],
)
def test_refuses_what_the_vocabulary_parallel_loss_cannot_split(overrides, keys, match):
    config = FSDP2Config(sharding_size="auto", tensor_parallel_size=2, **keys)
    with pytest.raises(FSDP2ConfigError, match=match):
        build_plan(config, _chunked_qwen3(**overrides), 4)


def _lora_qwen3(**settings) -> Qwen3ForCausalLM:
    from peft import LoraConfig, inject_adapter_in_model

    model = _qwen3()
    with torch.device("meta"):
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj", "o_proj"], **settings), model)
    return model


def test_lora_adapters_follow_their_base_layers_placement():
    plan = dict(build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=2), _lora_qwen3(), 4).tp_plan)
    attn = "model.layers.0.self_attn"
    assert plan[f"{attn}.q_proj.base_layer"] == plan[f"{attn}.q_proj.lora_B.default"] == "colwise"
    assert plan[f"{attn}.o_proj.base_layer"] == plan[f"{attn}.o_proj.lora_A.default"] == "rowwise"
    assert f"{attn}.q_proj.lora_A.default" not in plan and f"{attn}.o_proj.lora_B.default" not in plan


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"lora_dropout": 0.1}, "LoRA adapters of 'model.layers.0.self_attn.q_proj': adapter 'default' has dropout"),
        ({"use_dora": True}, "DoRA"),
    ],
)
def test_refuses_lora_settings_that_cannot_follow_the_split(settings, match):
    with pytest.raises(FSDP2ConfigError, match=match):
        build_plan(FSDP2Config(sharding_size="auto", tensor_parallel_size=2), _lora_qwen3(**settings), 4)


def test_context_parallel_groups_with_tensor_parallelism_and_ulysses_heads_per_rank():
    """With TP a context-parallel group takes every ``tp``-th rank; Ulysses scatters each rank's ``heads / tp``
    heads over it, so those must divide by ``context_parallel_size`` (refused naming the key); KV all-gather splits
    no heads."""
    from lightning_mm.core.context_parallel import context_parallel_plan
    from lightning_mm.core.parallel_layout import LayoutError, config_layout

    keys = {"sharding_size": "auto", "tensor_parallel_size": 2, "context_parallel_size": 2}
    layout = config_layout(FSDP2Config(**keys, context_parallel_algo="kv_allgather"), 8)
    assert (layout.tp, layout.cp, layout.samplers, layout.cp_algo) == (2, 2, 2, "kv_allgather")
    plan = context_parallel_plan(8, 2, "kv_allgather", tp=2)  # every other rank: TP's ranks are consecutive
    assert plan.groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [plan.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "(each group ranks 2 apart); groups: [0,2], [1,3], [4,6], [5,7]" in plan.describe()
    assert "dp x cp = 4 ranks (tensor_parallel_size 2 inside)" in plan.describe()
    two_kv = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    layout.check_model(two_kv)  # KV all-gather: 1 key/value head per rank is fine
    ulysses = config_layout(FSDP2Config(**keys), 4)
    ulysses.check_model(Qwen3Config(**{**two_kv.to_dict(), "num_key_value_heads": 4}))
    with pytest.raises(LayoutError, match="`context_parallel_size`: 2 does not divide .*num_key_value_heads 2 / "):
        ulysses.check_model(two_kv)
