"""The strategy's tuned default (see benchmarks/README.md): what it changes, and that results do not change.

One 2-rank launch of tests/scenarios/tuning_scenarios.py; no timing is asserted anywhere.
"""

from pathlib import Path

import pytest

from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import tuning_scenarios

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuning")
    run(tuning_scenarios.tuning, out)
    return read_results(out, "tuning")


def test_root_and_last_unit_keep_parameters_from_forward_to_backward(ranks):
    for r in ranks:
        # Between forward and backward: the root and the last unit to run hold full parameters; the others do not.
        assert r["tuned"]["states"] == {
            "root": "UNSHARDED",
            "layers.0": "SHARDED",
            "layers.1": "SHARDED",
            "layers.2": "UNSHARDED",
        }
        assert r["tuned"]["kept"] == ["<root>", "layers.2"]
        # Without the tuning every unit is resharded after its forward.
        assert set(r["before"]["states"].values()) == {"SHARDED"} and r["before"]["kept"] == []


def test_tuning_leaves_losses_and_weights_bit_identical(ranks):
    for r in ranks:
        assert len(r["tuned"]["losses"]) == 4
        assert r["tuned"]["losses"] == r["before"]["losses"]
        assert r["tuned"]["weights"] == r["before"]["weights"]
    assert ranks[0]["tuned"]["weights"] == ranks[1]["tuned"]["weights"]


def test_fused_optimizer_step_is_chosen_and_matches_torchs_default(ranks):
    for r in ranks:
        assert r["tuned"]["fused"] == [True]  # what the update read
        assert r["tuned"]["fused_after"] == [None]  # never left in the user's group
        assert r["unfused"]["fused"] == [None]
        # Same update to rounding: the fused kernel is not bit-identical to torch's per-parameter loop.
        assert r["tuned"]["losses"] == pytest.approx(r["unfused"]["losses"][:4], rel=1e-5)


def test_fused_step_resumes_a_checkpoint_saved_without_it(ranks):
    for r in ranks:
        resumed = r["resumed_fused"]
        assert resumed["fused"] == [True]  # the run's own implementation choice, not the checkpoint's
        # Steps 5 and 6 continue from the saved moments: the same losses and weights as the uninterrupted run.
        assert resumed["losses"] == pytest.approx(r["unfused"]["losses"][4:], rel=1e-5)
        for name, values in r["unfused"]["weights"].items():
            assert resumed["weights"][name] == pytest.approx(values, rel=1e-4, abs=1e-6), name


def test_fused_step_skips_groups_mixing_dtensors_and_plain_trainable_parameters(ranks):
    for r in ranks:
        assert r["ignored_trainable"]["fused"] == [None]  # one fused call cannot hold both kinds
        assert r["ignored_frozen"]["fused"] == [True]  # frozen parameters are not stepped
        assert len(r["ignored_trainable"]["losses"]) == len(r["ignored_frozen"]["losses"]) == 4
