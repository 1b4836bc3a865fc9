"""Vision data-parallel balancing (``encoder_dp_balance``): the cost model, the assignment, the config keys, and
the exactness of balanced training against the unbalanced run on 2 and 4 gloo ranks
(``tests/scenarios/vision_balance_scenarios.py``)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.core.vision_work_balance import (
    CostCalibration,
    VisionCost,
    assign_images,
    attention_term,
    fit_cost,
    load_spread,
    plan_route,
)
from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import vision_balance_scenarios

REL = 1e-5


# ------------------------------------------------------------------------------------------------ assignment
def _best_makespan(costs: list[float], world: int) -> float:
    best = float("inf")
    for ranks in itertools.product(range(world), repeat=len(costs)):
        loads = [0.0] * world
        for c, r in zip(costs, ranks):
            loads[r] += c
        best = min(best, max(loads))
    return best


def test_lpt_is_within_grahams_bound_of_the_best_assignment_and_deterministic():
    rng = random.Random(0)
    for trial in range(30):
        world = 2 + trial % 3
        n = rng.randint(world, 7)
        costs = [float(int(8 * rng.paretovariate(1.2))) + 1 for _ in range(n)]
        owners = [rng.randrange(world) for _ in range(n)]
        encoders = assign_images(costs, owners, world)
        assert encoders == assign_images(list(costs), list(owners), world)  # same on every rank
        loads = [sum(c for c, e in zip(costs, encoders) if e == r) for r in range(world)]
        assert max(loads) <= (4 / 3 - 1 / (3 * world)) * _best_makespan(costs, world) + 1e-9
        assert all(loads)  # n >= world: every rank encodes something


def test_lpt_keeps_an_image_home_when_loads_tie():
    # Already even: nothing moves (no transfer for equally loaded ranks).
    assert assign_images([5.0, 5.0, 5.0, 5.0], [1, 0, 3, 2], 4) == [1, 0, 3, 2]
    # The largest image starts on its owner; the rest fill the least loaded ranks.
    assert assign_images([1.0, 9.0, 4.0, 4.0], [0, 1, 1, 1], 2) == [0, 1, 0, 0]


def test_route_counts_and_spread():
    grids = [[(1, 8, 8), (1, 4, 4)], [(1, 2, 2)]]
    route = plan_route(grids, 0, VisionCost())
    assert route.encoders == [0, 1, 1]
    assert route.send_counts() == [64, 16] and route.recv_counts() == [64, 0]
    assert route.send_counts(unit=4) == [16, 4]
    assert plan_route(grids, 1, VisionCost()).recv_counts() == [16, 4]
    assert load_spread(route.unbalanced_loads()) == pytest.approx(80 / 42)
    assert load_spread(route.loads()) == pytest.approx(64 / 42)


# ------------------------------------------------------------------------------------------------ cost model
@pytest.mark.parametrize("grid", [(1, 8, 8), (1, 6, 10), (2, 4, 12), (1, 2, 2), (1, 14, 6)])
def test_window_attention_term_equals_the_windows_of_qwen2_5_vl(grid):
    """The windows (and frames) Qwen2.5-VL's own ``get_vision_window_index`` builds, window_size 112, patch 14."""
    from transformers.vision_utils import get_vision_window_index

    _, cu = get_vision_window_index(torch.tensor([grid]), spatial_merge_size=2, window_size=112, patch_size=14)
    spans = torch.diff(torch.unique_consecutive(cu)).tolist()
    windowed = float(sum(s * s for s in spans))
    t, h, w = grid
    assert attention_term(grid, window=8, full_fraction=0.0) == windowed
    assert attention_term(grid) == t * float(h * w) ** 2
    assert attention_term(grid, window=8, full_fraction=0.25) == pytest.approx(
        0.25 * t * (h * w) ** 2 + 0.75 * windowed
    )


def test_calibration_fits_linear_and_quadratic_costs_from_times():
    a, b = 2e-4, 3e-7
    samples = [(float(p), float(q), a * p + b * q) for p, q in [(64, 4096), (100, 2000), (16, 256), (300, 90000)]]
    cost = fit_cost(samples)
    assert cost.linear == 1.0 and cost.quadratic == pytest.approx(b / a, rel=1e-6)
    # times that fall with attention (noise): the quadratic coefficient is dropped, never negative
    clamped = fit_cost([(p, q, a * p - 1e-8 * q) for p, q, _ in samples])
    assert clamped == VisionCost(1.0, 0.0)
    calibration = CostCalibration(calls=2)
    calibration.add(samples[:2])
    assert not calibration.done and calibration.cost() == VisionCost()
    calibration.add(samples[2:])
    assert calibration.done and calibration.cost().quadratic == pytest.approx(b / a, rel=1e-6)


# ------------------------------------------------------------------------------------------------ config
def test_config_keys_default_off_and_validate():
    config = FSDP2Config()
    assert config.encoder_dp_balance is False and config.encoder_dp_balance_cost is None
    given = FSDP2Config.from_dict({"encoder_dp_balance": True, "encoder_dp_balance_cost": [1, 0.5]})
    assert given.encoder_dp_balance and given.encoder_dp_balance_cost == [1.0, 0.5]
    for key, value, words in [
        ("encoder_dp_balance", "yes", "true or false"),
        ("encoder_dp_balance_cost", [1.0], "[linear, quadratic]"),
        ("encoder_dp_balance_cost", [0, 0], "not both 0"),
        ("encoder_dp_balance_cost", [-1, 2], "non-negative"),
        ("encoder_dp_balance_calibration_steps", 0, "positive integer"),
    ]:
        with pytest.raises(FSDP2ConfigError, match=rf"`{key}`.*{words}"):
            FSDP2Config.from_dict({key: value}, source="job.yaml")


def test_the_plan_shows_whether_the_vision_tower_is_balanced():
    from lightning_mm.core.sharding_plan import build_plan

    def line(**keys: object) -> str:
        text = build_plan(FSDP2Config.from_dict(keys), torch.nn.Sequential(torch.nn.Linear(2, 2)), 2).describe()
        return next(x for x in text.splitlines() if "encoder_dp_balance" in x)

    assert line() == "  encoder_dp_balance: off (each rank encodes its own images)"
    assert line(encoder_dp_balance=True).endswith("by estimated cost: calibrated on the first 4 tower calls)")
    given = line(encoder_dp_balance=True, encoder_dp_balance_cost=[1, 0.5])
    assert given.startswith("  encoder_dp_balance: on (") and given.endswith(": 1 * patches + 0.5 * attention)")


def test_a_model_without_a_grid_tower_is_refused_naming_the_key():
    from lightning_mm.hf.vision_tower_balance import enable_from_config, find_vision_towers
    from tests.scenarios.hf_scenarios import tiny_hf_model

    assert [n for n, _ in find_vision_towers(tiny_hf_model("qwen2_5_vl"))] == ["model.visual"]
    config = FSDP2Config.from_dict({"encoder_dp_balance": True}, source="job.yaml")
    with pytest.raises(FSDP2ConfigError, match=r"`encoder_dp_balance` in job.yaml: LlavaForConditionalGeneration"):
        enable_from_config(tiny_hf_model("llava"), config)


# ------------------------------------------------------------------------------------------------ multi-rank
launch_dirs: dict[int, object] = {}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def launch(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"vision_balance{request.param}")
    run(vision_balance_scenarios.exactness, out, launcher="torchrun", nproc=request.param, timeout=600)
    launch_dirs[request.param] = out
    return request.param, read_results(out, "exactness", request.param), read_results(out, "empty_share", 2)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_balanced_training_equals_the_unbalanced_run(launch):
    world, ranks, _ = launch
    assert list(ranks[0]) == [
        "qwen2_5_vl",
        "qwen2_5_vl-recompute",
        "qwen2_5_vl-frozen-calibrated",
        "qwen3_vl",
        "qwen3_vl-recompute-calibrated",
        "qwen3_vl-frozen",
    ]
    for name, case in ranks[0].items():
        assert all(r[name]["losses"] == case["losses"] for r in ranks)  # the global loss, on every rank
        assert max(map(_rel, case["losses"], case["reference_losses"])) < REL, name
        assert case["weight_rel_error"] < REL and case["weights_moved"] > 1e-2, name


def test_images_move_and_the_estimated_load_evens_out(launch):
    world, ranks, _ = launch
    for name, case in ranks[0].items():
        assert len(case["routes"]) == vision_balance_scenarios.STEPS, name
        for route in case["routes"]:
            assert route["encoders"] != route["owners"], name  # images were moved
            assert route["spread"] < route["unbalanced_spread"], name
            assert all(r[name]["routes"] == case["routes"] for r in ranks)  # one route on every rank
    calibrated = ranks[0]["qwen2_5_vl-frozen-calibrated"]["routes"]
    assert [r["fitted"] for r in calibrated] == [False, True, True]  # fitted after 2 calls (same on every rank)


def test_a_rank_with_nothing_to_encode_still_matches_the_plain_tower(launch):
    world, _, empty = launch
    assert [e["rows"] for e in empty] == ([1, 0] if world == 2 else [1, 1])  # 4 ranks: rank 3 holds none
    assert empty[0]["feature_error"] == 0.0
    assert all(e["grad_rel_error"] < REL for e in empty)


def test_the_strategy_balances_from_the_yaml_key_and_composes_with_context_parallelism(launch):
    world, _, _ = launch
    strategy = read_results(launch_dirs[world], "strategy", world)
    for r in strategy:
        assert r["cp"] == (2 if world == 4 else 1)  # 4 ranks: 2-way data x 2-way context parallelism
        assert r["balanced"]["balanced"] and r["balanced"]["moved"] and not r["unbalanced"]["balanced"]
        assert max(map(_rel, r["balanced"]["losses"], r["unbalanced"]["losses"])) < REL
        assert r["weight_rel_error"] < REL


def test_packed_rows_and_an_image_free_rank_train_as_the_unbalanced_run(launch):
    """2 ranks, Qwen2.5-VL, rows packed by PackedCollator with per-sample M-RoPE positions: images on both ranks
    (3 and 2); a text-only row with the filler image; a text-only row without it (the rank's model call has no
    images: the balanced tower is still called and its empty features join the loss, or the other rank would
    wait in the exchanges; the launch's process group times out instead of hanging)."""
    world, _, _ = launch
    if world != 2:
        pytest.skip("the packed cases run in the 2-rank launch")
    packed = read_results(launch_dirs[2], "packed", 2)
    assert [(r["images"]["images"], r["filler"]["images"], r["text"]["images"]) for r in packed] == [
        (3, 3, 3),
        (2, 1, 0),
    ]
    assert [r["images"]["samples"] for r in packed] == [2, 3] and packed[1]["filler"]["samples"] == 3
    for variant, case in packed[0].items():
        assert all(r[variant]["losses"] == case["losses"] for r in packed), variant
        assert max(map(_rel, case["losses"], case["reference_losses"])) < REL, variant
        assert case["weight_rel_error"] < REL, variant
        assert all(route["encoders"] != route["owners"] for route in case["routes"]), variant
    for route in packed[0]["text"]["routes"]:  # the text-only rank encodes some of rank 0's images
        assert 1 in route["encoders"] and 1 not in route["owners"]
