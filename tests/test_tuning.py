"""The strategy's tuned default (see benchmarks/README.md): what it changes, and that results do not change.

One 2-rank launch of tests/tuning_scenarios.py; no timing is asserted anywhere.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuning")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tuning_scenarios.py"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"tuning.rank{r}.json").read_text()) for r in range(2)]


def test_root_and_last_unit_keep_parameters_from_forward_to_backward(ranks):
    for r in ranks:
        # Between forward and backward: the root and the last unit to run hold full parameters; the others do not.
        assert r["tuned"]["states"] == {"root": "UNSHARDED", "layers.0": "SHARDED", "layers.1": "SHARDED",
                                        "layers.2": "UNSHARDED"}
        assert r["tuned"]["kept"] == ["<root>", "layers.2"]
        # Without the tuning every unit is resharded after its forward.
        assert set(r["before"]["states"].values()) == {"SHARDED"} and r["before"]["kept"] == []


def test_tuning_leaves_losses_and_weights_bit_identical(ranks):
    for r in ranks:
        assert len(r["tuned"]["losses"]) == 4
        assert r["tuned"]["losses"] == r["before"]["losses"]
        assert r["tuned"]["weights"] == r["before"]["weights"]
    assert ranks[0]["tuned"]["weights"] == ranks[1]["tuned"]["weights"]
