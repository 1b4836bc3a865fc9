"""MindSpeed MM's four later FSDP2 keys: loading, validation and the plan (no processes)."""

from __future__ import annotations

import pytest
import torch

from lightning_mm import FSDP2Config
from lightning_mm.core.config import FSDP2ConfigError
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.core.sharding_plan import build_plan
from tests.helpers.moe_models import MOE_MODULES, tiny_moe_model

EXPERTS = MOE_MODULES["qwen3_moe"]
LAYERS = "model.layers.{*}"

# The shapes of MindSpeed MM's own example configs (qwen3vl, glm4.5v), written here, not copied.
MINDSPEED_QWEN3VL_LIKE = """\
sharding_size: auto
reshard_after_forward: True
param_dtype: "bf16"
reduce_dtype: "fp32"
cast_forward_inputs: True
num_to_forward_prefetch: 1
num_to_backward_prefetch: 1
offload_to_cpu: False
align_fsdp_param_groups: True
expert_parallel_size: 1
reshard_local_experts: True
moe_modules:
  - model.language_model.layers.{*}.mlp.experts
"""
MINDSPEED_GLM_LIKE = """\
sharding_size: auto
reshard_after_forward: True
param_dtype: "bf16"
reduce_dtype: "fp32"
num_to_forward_prefetch: 0
num_to_backward_prefetch: 0
offload_to_cpu: False
align_fsdp_param_groups: False
"""


@pytest.fixture(scope="module")
def moe():
    with meta_parameters():
        return tiny_moe_model("qwen3_moe")


def test_defaults_are_mindspeed_mm_s():
    config = FSDP2Config()
    assert config.align_fsdp_param_groups is False
    assert config.expert_parallel_size == 1
    assert config.moe_modules == []
    assert config.reshard_local_experts is True


@pytest.mark.parametrize("text", [MINDSPEED_QWEN3VL_LIKE, MINDSPEED_GLM_LIKE])
def test_mindspeed_shaped_configs_load(tmp_path, text):
    path = tmp_path / "fsdp2_config.yaml"
    path.write_text(text)
    config = FSDP2Config.from_yaml(path)
    assert config.expert_parallel_size == 1
    assert FSDP2Config.from_dict(config.to_dict()) == config


def test_round_trip_and_explicit_keys():
    config = FSDP2Config.from_dict(
        {
            "expert_parallel_size": 2,
            "moe_modules": EXPERTS,
            "reshard_local_experts": False,
            "align_fsdp_param_groups": True,
        }
    )
    assert config.moe_modules == [EXPERTS] and config.reshard_local_experts is False
    assert {"expert_parallel_size", "moe_modules"} <= config.explicit_keys
    assert FSDP2Config.from_dict(config.to_dict()) == config


def test_unknown_key_still_suggests():
    with pytest.raises(
        FSDP2ConfigError, match="unknown FSDP2 config key `expert_parallel`.*did you mean `expert_parallel_size`"
    ):
        FSDP2Config.from_dict({"expert_parallel": 2})


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"align_fsdp_param_groups": "yes"}, "align_fsdp_param_groups"),
        ({"align_fsdp_param_groups": 1}, "align_fsdp_param_groups"),
        ({"reshard_local_experts": 0}, "reshard_local_experts"),
        ({"expert_parallel_size": 0}, "expert_parallel_size"),
        ({"expert_parallel_size": -2}, "expert_parallel_size"),
        ({"expert_parallel_size": True}, "expert_parallel_size"),
        ({"expert_parallel_size": "2"}, "expert_parallel_size"),
        ({"expert_parallel_size": 1.5}, "expert_parallel_size"),
        ({"moe_modules": [3]}, "moe_modules"),
        ({"moe_modules": {"a": 1}}, "moe_modules"),
        ({"moe_modules": ["layers.{0-"]}, "moe_modules"),
        ({"moe_modules": ["layers..experts"]}, "moe_modules"),
    ],
)
def test_bad_values_name_the_key(data, key):
    with pytest.raises(FSDP2ConfigError, match=f"`{key}`"):
        FSDP2Config.from_dict(data)


def _plan(model, world=4, **keys):
    return build_plan(
        FSDP2Config.from_dict({"sharding_size": "auto", "sub_modules_to_wrap": [LAYERS], **keys}), model, world
    )


def test_ep_must_divide_world_size(moe):
    with pytest.raises(FSDP2ConfigError, match="`expert_parallel_size`.*3 does not divide the world size 4"):
        _plan(moe, expert_parallel_size=3, moe_modules=[EXPERTS])


def test_experts_must_divide_by_ep(moe):
    with pytest.raises(
        FSDP2ConfigError,
        match="`expert_parallel_size`.*16 does not divide the 8 experts of 'model.layers.0.mlp.experts'",
    ):
        _plan(moe, world=16, expert_parallel_size=16, moe_modules=[EXPERTS])


def test_moe_modules_must_match(moe):
    with pytest.raises(FSDP2ConfigError, match="`moe_modules`.*no module at 'model.layers.0.mlp.expert'"):
        _plan(moe, expert_parallel_size=2, moe_modules=["model.layers.{*}.mlp.expert"])
    with pytest.raises(FSDP2ConfigError, match="`moe_modules`.*needs the MoE expert modules"):
        _plan(moe, expert_parallel_size=2)
    with pytest.raises(FSDP2ConfigError, match="`moe_modules`.*also in `sub_modules_to_wrap`"):
        _plan(moe, expert_parallel_size=2, moe_modules=[EXPERTS], sub_modules_to_wrap=[LAYERS, EXPERTS])
    with pytest.raises(FSDP2ConfigError, match="`moe_modules`.*'model.layers.0.self_attn.q_norm'.*leading experts"):
        _plan(moe, expert_parallel_size=2, moe_modules=["model.layers.0.self_attn.q_norm"])


def test_plan_shows_ep_mesh_experts_and_bytes(moe):
    plan = _plan(moe, expert_parallel_size=2, moe_modules=[EXPERTS])
    ep = plan.experts
    assert ep.moe_modules == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert ep.num_experts == 8 and ep.experts_per_rank == 4 and ep.reshard_local_experts
    assert plan.ep_mesh_shape == (2, 2)
    expert_numel = sum(p.numel() for n, p in moe.named_parameters() if ".mlp.experts." in n)
    total = sum(p.numel() for p in moe.parameters())
    assert ep.expert_params == expert_numel and ep.expert_bytes == 4 * expert_numel
    # Expert parameters are not counted in their layer's unit: the experts are sharded on their own mesh.
    assert sum(u.num_params for u in plan.units) + plan.root_params == total - expert_numel
    other, expert = plan.bytes_per_rank()
    assert expert == 4 * expert_numel // 4 and other == -(-4 * (total - expert_numel) // 4)
    whole = _plan(moe, expert_parallel_size=4, moe_modules=[EXPERTS], reshard_local_experts=False)
    assert whole.bytes_per_rank()[1] == 4 * expert_numel // 4 and whole.experts.experts_per_rank == 2
    text = plan.describe()
    assert "expert parallel: mesh (ep_replicate=2 x ep=2)" in text and "8 experts each, 4 per rank" in text
    assert "parameter bytes per rank" in text and "FSDP-sharded over ep_replicate" in text
    assert "kept whole, gradients all-reduced over ep_replicate" in whole.describe()


def test_moe_modules_without_ep_is_a_note(moe):
    plan = _plan(moe, moe_modules=["model.layers.{*}.mlp.nothing"])  # not resolved without EP, as in MindSpeed MM
    assert plan.experts is None and any("`moe_modules` is not used" in n for n in plan.notes)


def test_aligned_unit_holds_exactly_norms_and_routers(moe):
    plain = _plan(moe)
    plan = _plan(moe, align_fsdp_param_groups=True)
    (aligned,) = [u for u in plan.units if u.label]
    expected = sorted(
        [
            f"model.layers.{i}.{m}"
            for i in range(2)
            for m in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate")
        ]
        + ["model.norm"]
    )
    assert sorted(aligned.modules) == expected
    params = dict(moe.named_parameters())
    assert aligned.num_params == sum(p.numel() for n, p in params.items() if n.rpartition(".")[0] in expected)
    assert aligned.keep_unsharded and plan.units[0] is aligned  # applied before the layers that contain it
    layers = {u.name: u.num_params for u in plan.units if not u.label}
    for i in range(2):
        linear_only = sum(
            p.numel()
            for n, p in params.items()
            if n.startswith(f"model.layers.{i}.") and n.rpartition(".")[0] not in expected
        )
        assert layers[f"model.layers.{i}"] == linear_only
    assert plan.root_params == plain.root_params - moe.model.norm.weight.numel()
    assert "<norms and routers: 11 modules>" in plan.describe()


def test_align_needs_norms_inside_units():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(FSDP2ConfigError, match="`align_fsdp_param_groups`.*no norm or router"):
        build_plan(FSDP2Config(sub_modules_to_wrap=["0"], align_fsdp_param_groups=True), net, 1)
