"""ShardingPlan: deciding without processes (units, groups, ignored, recompute, precision)."""

import pytest
import torch
from torch import nn

from lightning_mm import FSDP2Config
from lightning_mm.core.config import FSDP2ConfigError
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.core.precision_policy import resolve_precision_policy
from lightning_mm.core.sharding_plan import build_plan
from lightning_mm.strategies.precision import MMFSDP2Precision


class Net(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3))
        self.vision = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def plan_for(model, world=4, **config):
    return build_plan(FSDP2Config.from_dict(config), model, world)


def test_units_children_first_with_counts():
    plan = plan_for(Net(), sub_modules_to_wrap=["blocks", "blocks.{*}", "blocks.{0}.{*}"], sharding_size="auto")
    order = [u.modules for u in plan.units]
    assert order.index(("blocks.0.0",)) < order.index(("blocks.0",)) < order.index(("blocks",))
    counts = {u.name: u.num_params for u in plan.units}
    assert counts["blocks.0.0"] == 20 and counts["blocks.0"] == 0 and counts["blocks.1"] == 40
    assert plan.root_params == 40 + 20 + 40  # embed, vision, head stay with the root
    assert plan.mesh_shape == (4,) and plan.mesh_dim_names == ("shard",) and not plan.is_hsdp


def test_hsdp_mesh_from_sharding_size():
    plan = plan_for(Net(), world=8, sharding_size=2)
    assert plan.mesh_shape == (4, 2) and plan.mesh_dim_names == ("replicate", "shard") and plan.is_hsdp
    with pytest.raises(FSDP2ConfigError, match="sharding_size"):
        plan_for(Net(), world=6, sharding_size=4)


def test_tied_weights_in_two_units_are_grouped():
    plan = plan_for(Net(tie=True), sub_modules_to_wrap=["embed", "head", "blocks.{*}"])
    assert ("embed", "head") in [u.modules for u in plan.units]
    grouped = next(u for u in plan.units if u.modules == ("embed", "head"))
    assert grouped.num_params == 40  # the shared weight counted once
    assert any("tied" in note for note in plan.notes)


def test_tied_weight_shared_with_the_root_dissolves_the_unit():
    plan = plan_for(Net(tie=True), sub_modules_to_wrap=["embed", "blocks.{*}"])
    assert ("embed",) not in [u.modules for u in plan.units]
    assert any("'embed' shares parameters" in note for note in plan.notes)


def test_ignored_and_recompute():
    plan = plan_for(
        Net(), sub_modules_to_wrap=["blocks.{*}"], ignored_modules=["vision"], recompute_modules=["blocks.{0,2}"]
    )
    assert plan.ignored_modules == ("vision",) and plan.ignored_params == 20
    assert plan.recompute_modules == ("blocks.0", "blocks.2")
    assert plan.root_params == 40 + 40


def test_wrapped_inside_ignored_is_an_error():
    with pytest.raises(FSDP2ConfigError, match="'blocks.0' is inside `ignored_modules` module 'blocks'"):
        plan_for(Net(), sub_modules_to_wrap=["blocks.{*}"], ignored_modules=["blocks"])


def test_partly_ignored_shared_parameter_is_an_error():
    with pytest.raises(FSDP2ConfigError, match="partly in `ignored_modules`"):
        plan_for(Net(tie=True), ignored_modules=["head"])


def test_pattern_errors_name_the_key_and_file(tmp_path):
    path = tmp_path / "fsdp2_config.yaml"
    path.write_text("recompute_modules: ['blocks.{0-5}']\n")
    with pytest.raises(FSDP2ConfigError, match=r"fsdp2_config.yaml.*`recompute_modules`.*blocks.3"):
        build_plan(FSDP2Config.from_yaml(path), Net(), 2)


def test_plan_builds_on_a_meta_model_and_describes_itself():
    with meta_parameters():
        model = Net()
    assert all(p.is_meta for p in model.parameters())
    plan = plan_for(
        model,
        sub_modules_to_wrap=["blocks.{*}"],
        ignored_modules=["vision"],
        recompute_modules=["blocks.1"],
        sharding_size="auto",
    )
    text = plan.describe()
    fragments = ("FSDP, world size 4", "blocks.2", "<root>", "ignored (20 params", "recomputed (reentrant): blocks.1")
    for fragment in fragments:
        assert fragment in text


def test_meta_parameters_keep_buffers_and_ties():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(4.0))
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

    with meta_parameters():
        model = WithBuffer()
    assert model.a.weight.is_meta and model.b.weight is model.a.weight
    assert not model.table.is_meta and model.table.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert model.a.weight.requires_grad
    assert not nn.Linear(2, 2).weight.is_meta  # the hook is gone after the context


@pytest.mark.parametrize(
    ("precision", "yaml", "expected"),
    [
        ("32-true", {}, (None, None)),
        ("32-true", {"param_dtype": "bf16"}, (torch.bfloat16, None)),
        ("bf16-mixed", {}, (torch.bfloat16, torch.float32)),
        ("bf16-mixed", {"reduce_dtype": "bf16"}, (torch.bfloat16, torch.bfloat16)),
        ("bf16-mixed", {"param_dtype": "bf16", "reduce_dtype": "fp32"}, (torch.bfloat16, torch.float32)),
        ("bf16-true", {}, (None, None)),
    ],
)
def test_precision_resolution(precision, yaml, expected):
    mp = resolve_precision_policy(FSDP2Config.from_dict(yaml), precision)
    assert (mp.param_dtype, mp.reduce_dtype) == expected


def test_contradictory_precision_is_an_error():
    with pytest.raises(FSDP2ConfigError, match="`param_dtype`.*contradicts.*bf16-mixed"):
        resolve_precision_policy(FSDP2Config(param_dtype="fp16"), "bf16-mixed")
    with pytest.raises(FSDP2ConfigError, match="contradicts"):
        resolve_precision_policy(FSDP2Config(param_dtype="fp32"), "bf16-true")


def test_fp16_mixed_is_rejected_clearly():
    with pytest.raises(ValueError, match="16-mixed.*sharded gradient scaler"):
        MMFSDP2Precision("16-mixed")
    with pytest.raises(ValueError, match="does not support precision='64-true'"):
        resolve_precision_policy(FSDP2Config(), "64-true")


def test_seed_default_sharding_size_replicates_and_says_so():
    plan = plan_for(Net(), world=4)
    assert plan.mesh_shape == (4, 1)
    assert "replicated, not sharded" in plan.describe()


def test_the_plan_carries_the_root_and_last_unit_kept_unsharded_for_backward():
    plan = plan_for(Net(), sub_modules_to_wrap=["blocks.{*}"])
    assert plan.keep_unsharded_for_backward and "except the root and the last unit to run" in plan.describe()
    undone = build_plan(FSDP2Config(sub_modules_to_wrap=["blocks.{*}"]), Net(), 4, keep_unsharded_for_backward=False)
    assert not undone.keep_unsharded_for_backward and "except the root" not in undone.describe()
    zero2 = plan_for(Net(), sub_modules_to_wrap=["blocks.{*}"], reshard_after_forward=False)
    assert "except the root" not in zero2.describe()  # nothing is resharded after forward anyway


def test_the_plan_says_which_paths_are_ignored():
    plan = plan_for(Net(), sub_modules_to_wrap=["blocks.{*}"], ignored_modules=["vision", "blocks.1.0"])
    assert plan.is_ignored("vision") and plan.is_ignored("vision.weight") and plan.is_ignored("blocks.1.0.bias")
    assert not plan.is_ignored("visionary.weight") and not plan.is_ignored("blocks.1.1.weight")


def test_ignored_modules_have_one_owner_that_casts_places_and_lists_them():
    from lightning_mm.core.ignored import IgnoredModules
    from lightning_mm.core.precision_policy import PrecisionPolicy

    model = Net()
    model.vision.bias.requires_grad_(False)
    config = FSDP2Config(sub_modules_to_wrap=["blocks.{*}"], ignored_modules=["vision"])
    plan = build_plan(config, model, 4, PrecisionPolicy(param_dtype=torch.bfloat16))
    ignored = IgnoredModules(model, plan)
    assert ignored and ignored.modules == [model.vision]
    assert ignored.parameters() == {model.vision.weight, model.vision.bias}
    assert ignored.trainable_parameters() == [model.vision.weight]
    ignored.cast_inputs()  # FSDP casts the batch to bf16; the fp32 ignored module gets fp32 inputs back
    assert model.vision(torch.ones(2, 4, dtype=torch.bfloat16)).dtype == torch.float32
    ignored.place(torch.device("meta"))
    assert model.vision.weight.is_meta and not model.head.weight.is_meta
    assert not IgnoredModules(model, plan_for(model))


def test_key_error_words_a_config_error_with_its_key_and_file():

    in_file = FSDP2Config.from_dict({}, source="fsdp2.yaml")
    err = in_file.key_error("moe_modules", "'x' has no parameters")
    assert isinstance(err, FSDP2ConfigError)
    assert str(err) == "FSDP2 config key `moe_modules` in fsdp2.yaml: 'x' has no parameters"
    assert str(in_file.key_error(None, "a problem")) == "FSDP2 config in fsdp2.yaml: a problem"
    assert str(FSDP2Config().key_error("sharding_size", "bad")) == "FSDP2 config key `sharding_size`: bad"
