"""Gradient clipping over DTensors against torch's public ``get_total_norm`` / ``clip_grads_with_norm_`` (2 gloo
ranks, ``tests/scenarios/clip_scenarios.py``). torch's functions are used there per mesh group, since they refuse mixed
lists; the figures behind keeping this project's arithmetic are in benchmarks/README.md."""

from pathlib import Path

import pytest

from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import clip_scenarios

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip")
    run(clip_scenarios.clip, out, launcher="torchrun")
    ranks = read_results(out, "clip")
    assert ranks[0] == ranks[1]  # the norms and differences are global: identical on both ranks
    return ranks[0]


def test_cases_cover_fsdp_plain_hsdp_two_meshes_and_bf16(results):
    cases = {key.split("/")[0] for key in results}
    assert cases == {"fsdp", "mixed", "hsdp_2x1", "hsdp_1x2", "two_meshes", "bf16"}
    assert {key.split("/")[1] for key in results} == {"2.0", "1.0", "inf"}


def test_our_norm_equals_the_gathered_float64_norm(results):
    for key, r in results.items():
        assert r["ours"] == pytest.approx(r["reference"], rel=2e-7), key


def test_torch_per_group_matches_ours_in_fp32(results):
    for key, r in results.items():
        if not key.startswith("bf16"):
            assert r["torch"] == pytest.approx(r["ours"], rel=1e-6), key  # not bit-equal: float rounding
            assert r["clipped_max_rel_diff"] < 1e-6, key  # the clip coefficient: float64 here, float32 in torch
