"""Transformers integration on 2 CPU ranks (gloo): every built-in family loaded shard by shard and trained.

One launch of tests/scenarios/hf_scenarios.py covers all families (see ``scenario_all``); the tests below assert on what
each rank recorded. The InternVL example runs in a second launch.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.scenario_kit import read_results, run, scenario_env
from tests.scenarios import hf_scenarios
from tests.scenarios.hf_scenarios import FAMILIES, save_tiny_checkpoints

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return scenario_env()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    ckpts = tmp_path_factory.mktemp("hf_ckpts")
    out = tmp_path_factory.mktemp("hf_out")
    save_tiny_checkpoints(ckpts)
    run(hf_scenarios.all_scenarios, out, args={"ckptdir": ckpts}, timeout=600)
    return {name: read_results(out, name) for name in ("families", "random_init", "hsdp_freeze")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_load_gathers_exactly_the_saved_weights(ranks, family):
    for r in ranks["families"]:
        obs = r[family]
        assert obs["model_class"] == f"MM{FAMILIES[family][0]}"
        assert obs["not_equal"] == [], "gathered weights differ from the checkpoint"
        assert obs["buffers_not_equal"] == [], "buffers (rotary tables) differ from from_pretrained's"
        assert obs["pending_cleared"]
        # Decoder layers are sharded over the 2 ranks on dim 0: each holds half of the rows.
        assert obs["layer_is_dtensor"] and obs["layer_local_shape"][0] * 2 == obs["layer_global_shape"][0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_first_batch_loss_equals_the_unsharded_model_and_training_lowers_it(ranks, family):
    r0, r1 = (r[family] for r in ranks["families"])
    for obs in (r0, r1):
        assert obs["losses"][0] == pytest.approx(obs["ref_losses"][0], rel=1e-6, abs=1e-6)
        assert all(math.isfinite(x) for x in obs["losses"])
        assert obs["losses"][-1] < obs["losses"][0] - 0.3
    assert r0["ref_losses"][0] != r1["ref_losses"][0], "ranks should see distinct batches"
    assert r0["final"] == r1["final"], "ranks disagree on the trained weights"
    changed = [n for n in r0["initial"] if r0["initial"][n] != r0["final"][n]]
    assert changed


@pytest.mark.parametrize("family", ["llama_tied", "internvl"])
def test_tied_embeddings_train_and_stay_tied(ranks, family):
    for r in ranks["families"]:
        obs = r[family]
        assert obs["tied_same_object"] and obs["tied_equal"]
        assert ["model.embed_tokens", "lm_head"] in obs["plan_units"] or [
            "model.language_model.embed_tokens",
            "lm_head",
        ] in obs["plan_units"]
        embed = next(n for n in obs["initial"] if n.endswith("embed_tokens.weight"))
        assert obs["initial"][embed] != obs["final"][embed]
    assert ranks["families"][0]["qwen2"]["tied_same_object"] is False


def test_frozen_vision_tower_is_ignored_unsharded_and_gets_no_gradient(ranks):
    for r in ranks["families"]:
        obs = r["internvl"]
        tower = [n for n in obs["initial"] if n.startswith("model.vision_tower.")]
        assert obs["plan_ignored"] == ["model.vision_tower"]
        assert sorted(tower) == obs["frozen"] == obs["grad_none"]
        assert not any(n in obs["sharded"] for n in tower)
        assert all(obs["initial"][n] == obs["final"][n] for n in tower)
        assert all(obs["initial"][n] != obs["final"][n] for n in obs["sharded"] if "layers.0." in n)
        assert obs["not_equal"] == []  # the ignored tower's full weights were loaded too


def test_random_init_without_checkpoint_is_initialised_after_sharding(ranks):
    r0, r1 = ranks["random_init"]
    for obs in (r0, r1):
        assert obs["is_dtensor"] and not obs["any_nan"] and obs["norms_one"] and obs["pad_row_zero"]
        assert 0.04 < obs["q_std"] < 0.06  # initializer_range 0.05
        assert obs["inv_freq"] == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-6)
        assert all(math.isfinite(x) for x in obs["losses"])
    assert r0["q_full_sum"] == r1["q_full_sum"]


def test_hsdp_load_from_a_multi_file_checkpoint_with_frozen_parts_of_units(ranks):
    r0, r1 = ranks["hsdp_freeze"]
    for obs in (r0, r1):
        assert obs["mesh"] == [2, 1] and obs["layer_placements"] == ["R", "S(0)"]
        assert obs["layer_local_shape"] == obs["layer_global_shape"]  # a shard group of one rank: whole tensors
        assert obs["not_equal"] == [] and obs["buffers_not_equal"] == []
        assert obs["losses"][0] == pytest.approx(obs["ref_losses"][0], rel=1e-6, abs=1e-6)
        frozen = [n for n in obs["initial"] if n.startswith(("model.layers.0.", "model.layers.1.self_attn."))]
        assert obs["frozen"] == sorted(frozen) and set(frozen) <= set(obs["grad_none"])
        assert all(obs["initial"][n] == obs["final"][n] for n in frozen)
        trained = [n for n in obs["initial"] if n not in frozen]
        assert all(obs["initial"][n] != obs["final"][n] for n in trained)
    assert r0["final"] == r1["final"]


def test_internvl_example_trains_end_to_end(tmp_path):
    """examples/internvl: tiny InternVL built locally, seed adapter + ModelHub + TransformersModel, seed YAML."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "internvl" / "train.py"),
            "--steps",
            "8",
            "--hf-path",
            str(tmp_path / "tiny-internvl"),
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert (tmp_path / "tiny-internvl" / "model.safetensors").is_file()
    assert "model: InternVLChatModelGeneration; final metrics" in proc.stdout
    metrics = proc.stdout.split("final metrics: ")[1]
    train_loss = float(metrics.split("'train/loss': ")[1].split(",")[0])
    assert train_loss < math.log(256) - 0.5  # below chance over the 256-token vocabulary
    plan = proc.stdout + proc.stderr
    expected = "ignored (36,448 params, whole on every rank, trainable ones' gradients all-reduced): model.vision_tower"
    assert expected in plan
    assert "recomputed (reentrant): model.language_model.layers.0" in plan
