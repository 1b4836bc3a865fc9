"""2-rank CPU (gloo) tests: each config field is observed taking effect. See tests/scenarios/dist_scenarios.py."""

import math

import pytest

from tests.helpers.scenario_kit import run
from tests.scenarios import dist_scenarios


def test_seed_yaml_verbatim_trains_and_every_field_takes_effect(scenario):
    r0, r1 = scenario(dist_scenarios.seed_yaml)
    # sharding_size: auto -> 1-D mesh over both ranks; decoder layers are sharded on dim 0.
    assert r0["mesh"] == [2]
    assert r0["qkv_global_shape"] == [192, 64] and r0["qkv_local_shape"] == [96, 64]
    assert r0["embedding_is_dtensor"]
    # param_dtype bf16 + cast_forward_inputs: the layer computes in bf16 on bf16 inputs.
    assert r0["dtypes"]["input"] == "torch.bfloat16" and r0["dtypes"]["weight"] == "torch.bfloat16"
    # recompute_modules with use_reentrant (default true): forward under no_grad, then recomputed with grad.
    steps = len(r0["losses"])
    assert r0["forward_calls_layer0"] == 2 * steps and r0["forward_calls_with_grad"] == steps
    # ignored_modules: image_encoder stays unsharded, and its gradients are synchronised (ranks saw distinct
    # data, so unsynchronised gradients would leave different weights).
    assert not r0["image_encoder_is_dtensor"]
    assert r0["image_encoder_weights"] == r1["image_encoder_weights"]
    assert r0["losses"] != r1["losses"], "ranks should see distinct batches"
    # Sharded weights agree across ranks.
    assert r0["layer0_full_sum"] == r1["layer0_full_sum"]
    # Meta-device init: nothing left on meta, no NaN, norms initialised to one, buffers kept (rotary table).
    assert not r0["any_meta"] and not r0["any_nan"] and r0["norm_weight_ones"]
    assert r0["shard_halves_differ"], "every shard drew the same random numbers"
    expected = [1.0 / (10000.0 ** (i / 16)) for i in range(0, 16, 2)]
    assert r0["inv_freq"] == pytest.approx(expected, rel=1e-6)
    # Prefetch 2/2 in execution order (embedding, rotary, layers, output head).
    assert r0["prefetch_order"] == [
        "text_decoder.embedding",
        "text_decoder.rotary_pos_emb",
        "text_decoder.decoder.layers.0",
        "text_decoder.decoder.layers.1",
        "text_decoder.output_layer",
    ]
    assert r0["prefetch_forward_layer0"] == ["text_decoder.decoder.layers.1", "text_decoder.output_layer"]
    assert r0["prefetch_backward_layer1"] == ["text_decoder.decoder.layers.0", "text_decoder.rotary_pos_emb"]
    # MMLightningModule's AdamW: sharded parameters, then the ignored image encoder's, each group on the fused step.
    groups = r0["optimizer_groups"]
    assert [g["dtensor"] for g in groups] == [[True], [False]] and [g["fused"] for g in groups] == [True, True]
    # Clipping (gradient_clip_val=0.5) over DTensor shards plus plain (ignored) gradients: the strategy's norm
    # equals the norm of the gathered gradients, and clipping took effect.
    assert len(r0["norms"]) == len(r0["losses"])
    for rec in r0["norms"]:
        assert rec["before"] == pytest.approx(rec["before_reference"], rel=1e-5)
        assert rec["after"] == pytest.approx(rec["after_reference"], rel=1e-5)
        assert rec["before"] > 0.5 and rec["after"] == pytest.approx(0.5, rel=1e-3)
    # reshard_after_forward (default true): layer 0 is resharded by the time layer 1 runs.
    assert r0["layer0_state_in_layer1_forward"] == "SHARDED"
    # The loss falls.
    assert all(math.isfinite(x) for x in r0["losses"])
    assert min(r0["losses"][-3:]) < r0["losses"][0] - 0.5
    assert "ignored" in r0["plan"] and "text_decoder.decoder.layers.1" in r0["plan"]


def test_loss_parity_with_ddp_for_fsdp_and_hsdp_with_clipping_and_accumulation(scenario):
    ranks = scenario(dist_scenarios.parity)
    for r in ranks:
        ddp = r["ddp"]
        for name in ("fsdp", "hsdp"):
            assert r[name]["losses"] == pytest.approx(ddp["losses"], rel=1e-5, abs=1e-7), name
            for key, value in ddp["weights"].items():
                assert r[name]["weights"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
    # After clipping, the norm over DTensors (FSDP and HSDP meshes) matches the gathered gradients, at the limit.
    for name in ("fsdp", "hsdp"):
        assert len(ranks[0][name]["norms"]) == 6
        for rec in ranks[0][name]["norms"]:
            assert rec["before"] == pytest.approx(rec["before_reference"], rel=1e-6)
            assert rec["after"] == pytest.approx(rec["after_reference"], rel=1e-6)
            assert rec["before"] > 0.05 and rec["after"] == pytest.approx(0.05, rel=1e-3)
    # HSDP with sharding_size 1 on 2 ranks: (replicate=2, shard=1) mesh, replicated placement, equal weights.
    hsdp0, hsdp1 = ranks[0]["hsdp"], ranks[1]["hsdp"]
    assert hsdp0["mesh"] == [2, 1] and hsdp0["mesh_names"] == ["replicate", "shard"]
    assert hsdp0["placements"] == ["R", "S(0)"] and hsdp0["local_shape"] == [32, 16]
    assert hsdp0["weights"] == hsdp1["weights"]
    assert ranks[0]["fsdp"]["weights"] == ranks[1]["fsdp"]["weights"]


def test_gradient_accumulation_skips_reduce_scatter_until_last_micro_batch(scenario):
    r0, _ = scenario(dist_scenarios.accumulation)
    seen = [o["sharded_grad"] for o in r0["observed"]]
    # accumulate_grad_batches=3: gradients reach the sharded parameters only on every third micro-batch.
    assert seen == [False, False, True, False, False, True]


def test_tied_weights_are_grouped_into_one_unit_and_stay_tied(scenario):
    r0, _ = scenario(dist_scenarios.tied)
    assert r0["still_tied"]
    assert ["embed", "out"] in r0["plan_units"]
    assert any("tied" in n for n in r0["notes"])
    assert r0["losses"][-1] < r0["losses"][0]
    # Layers run in reverse registration order; prefetch follows execution, not registration.
    assert r0["order"] == ["embed", "layers.2", "layers.1", "layers.0"]
    assert r0["forward_prefetch"]["layers.2"] == ["layers.1"]
    assert r0["forward_prefetch"]["layers.1"] == ["layers.0"]


def test_custom_fully_shard_hook_takes_over_wrapping(scenario):
    r0, _ = scenario(dist_scenarios.custom_fully_shard)
    assert r0["calls"] == [{"config_attr": True, "mesh": [2]}]
    assert r0["layer_local_shape"] == [16, 32]
    assert r0["still_tied"]


def test_bf16_mixed_precision_and_cpu_offload_with_non_reentrant_recompute(scenario):
    r0, _ = scenario(dist_scenarios.bf16_offload)
    assert r0["param_dtype"] == "torch.bfloat16" and r0["reduce_dtype"] == "torch.float32"
    assert r0["dtypes"]["weight"] == "torch.bfloat16" and r0["dtypes"]["input"] == "torch.bfloat16"
    assert r0["sharded_param_dtype"] == "torch.float32"  # master weights stay fp32
    assert r0["offload_policy"] == "CPUOffloadPolicy" and r0["shard_device"] == "cpu"
    assert r0["forward_calls_with_grad"] == 4  # non-reentrant: forward and recompute both with grad, 2 steps
    assert r0["layer0_state_in_layer1_forward"] == "UNSHARDED"  # reshard_after_forward: false (ZeRO-2)


def test_registered_name_takes_config_from_the_module(scenario):
    r0, _ = scenario(dist_scenarios.registered_name)
    assert r0["strategy"] == "MMFSDP2Strategy"
    assert r0["units"] == [["text_decoder.decoder.layers.0"], ["text_decoder.decoder.layers.1"]]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("bad_pattern", "text_decoder.decoder.layer"),
        ("bad_index", "text_decoder.decoder.layers.2"),
        ("uninitialised", "0.scale"),
    ],
)
def test_bad_setups_fail_before_any_training_step(tmp_path, name, message):
    proc = run(getattr(dist_scenarios, name), tmp_path, expect_ok=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (tmp_path / "trained.marker").exists()


def test_mmdatamodule_resumes_mid_epoch_with_the_next_unseen_batch(scenario):
    for r in scenario(dist_scenarios.resume_data):
        full, resumed = r["full"], r["resumed"]
        assert len(full) == 12 and len(resumed) == 7
        # Steps 6..12 of the resumed run see the same batches (and losses) as the uninterrupted run.
        assert resumed == full[5:]


def test_meta_init_replicas_and_ignored_modules_agree_across_ranks_with_different_seeds(scenario):
    r0, r1 = scenario(dist_scenarios.hsdp_meta_init)
    assert r0["mesh"] == [2, 1]
    assert r0["layer_sum"] == r1["layer_sum"]  # HSDP replicas start from the same weights
    assert r0["ignored_sum"] == r1["ignored_sum"]  # and so do modules kept whole on every rank
    assert r0["norm_ones"]
