"""Expert parallelism and aligned parameter groups on 4 CPU ranks against one-process Transformers (issue #15).

One launch (``tests/scenarios/ep_scenarios.py``) trains every case of ``EP_CASES``, and the resume chain of
``CHAIN_STAGES`` (each stage resumes the last one's checkpoint with other expert-parallel settings, formats and CPU
offload), with ``Trainer(devices=4)`` and real gloo collectives; the references are plain Transformers models trained
here with the same AdamW over the same global batches (``tests/helpers/parity.py``). fp32: relative 1e-5 per micro-batch
loss.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.moe_models import register_moe_families, save_moe_checkpoints
from tests.helpers.parity import global_losses, global_steps, reference_run, relative_errors, weight_errors
from tests.helpers.scenario_kit import run
from tests.scenarios import ep_scenarios
from tests.scenarios.ep_scenarios import CHAIN, CHAIN_STAGES, DEVICES, EP_CASES, EP_CP_CASES, chain_checkpoint

ROOT = Path(__file__).resolve().parents[1]
FP32_LOSS = 1e-5
FP32_WEIGHTS = 3e-4  # as in tests/test_parity.py (AdamW amplifies fp32 rounding in near-cancelling elements)
CASES = {c.name: c for c in EP_CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    register_moe_families()
    ckpts = tmp_path_factory.mktemp("moe_ckpts")
    save_moe_checkpoints(ckpts)
    out = tmp_path_factory.mktemp("ep_runs")
    run(ep_scenarios.train, out, args={"ckptdir": ckpts}, env={"EP_ONLY": None}, timeout=600)  # every case
    return out, ckpts


def _ranks(out: Path, name: str) -> list[dict[str, Any]]:
    ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(DEVICES)]
    for r, data in enumerate(ranks):
        assert data["error"] is None, f"rank {r} of {name} failed:\n{data['error']}"
    return ranks


@pytest.mark.parametrize("name", list(CASES))
def test_losses_equal_transformers(runs, name):
    out, ckpts = runs
    case = CASES[name]
    ranks = [r["parts"][0] for r in _ranks(out, name)]
    steps = global_steps(case, ranks)
    assert len(steps) == case.steps and all(len(group) == DEVICES for micro in steps for group in micro)
    ref = reference_run(case, steps, ckpts / case.family)
    errors = relative_errors(global_losses(ranks), ref.losses)
    assert max(errors) < FP32_LOSS, f"{name}: per-step relative loss errors {errors}"


@pytest.mark.parametrize("name", [c.name for c in EP_CASES if c.clip])
def test_clipping_norm_equals_transformers(runs, name):
    """The norm that clipping uses counts every expert once (each EP rank holds other experts). AdamW hides a wrong
    clip factor in the losses (it divides a uniform scale out), so the norm itself is compared."""
    out, ckpts = runs
    case = CASES[name]
    ranks = [r["parts"][0] for r in _ranks(out, name)]
    ref = reference_run(case, global_steps(case, ranks), ckpts / case.family)
    assert len(ref.norms) == case.steps and all(n > case.clip for n in ref.norms)  # clipping acts on every step
    for rank in ranks:
        errors = relative_errors(rank["norms"], ref.norms)
        assert max(errors) < FP32_LOSS, f"{name}: per-step relative norm errors {errors}"


@pytest.mark.parametrize("case", EP_CP_CASES, ids=lambda c: c.name)
def test_expert_and_context_parallel_together_equal_transformers(runs, case):
    """EP with Ulysses context parallelism on 4 ranks (2 data parallel x 2 context parallel): per-step losses and
    the first step's gradients (every parameter; the experts as rank 0's local share) equal one-process
    Transformers over the same global batches."""
    from tests import test_context_parallel as cp_test

    out, ckpts = runs
    steps, losses = cp_test._global_steps(cp_test._ranks(out, case.name, DEVICES), 0, case.cp)
    assert len(steps) == case.steps
    _, ref_losses, ref_grads = cp_test._reference(case, steps, ckpts)
    errors = relative_errors(losses, ref_losses)
    assert max(errors) < FP32_LOSS, f"{case.name}: per-step relative loss errors {errors}"
    grads = torch.load(out / f"{case.name}.grad.pt")
    local = {n: ref[: grads[n].shape[0]] for n, ref in ref_grads.items()}  # rank 0 holds the first experts
    assert any(grads[n].shape != ref_grads[n].shape for n in ref_grads)  # the experts really are split
    grad_errors = cp_test._grad_errors(grads, local)
    assert max(grad_errors.values()) < FP32_LOSS, sorted(grad_errors.items(), key=lambda kv: -kv[1])[:3]


def test_aligned_unit_holds_exactly_the_norms_and_routers(runs):
    out, _ = runs
    aligned = _ranks(out, "qwen3_moe-align")[0]["parts"][0]["aligned"]
    expected = sorted(
        [
            f"model.layers.{i}.{m}.weight"
            for i in range(2)
            for m in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate")
        ]
        + ["model.norm.weight"]
    )
    assert aligned == expected


@pytest.fixture(scope="module")
def chain(runs) -> tuple[list[list[dict[str, Any]]], Any, str | None]:
    """The resume chain: per stage, each rank's record; the reference over the stages that ran; the error."""
    out, ckpts = runs
    ranks = [json.loads((out / f"{CHAIN.name}.rank{r}.json").read_text()) for r in range(DEVICES)]
    done = min(len(r["parts"]) for r in ranks)
    stages = [[r["parts"][i] for r in ranks] for i in range(done)]
    steps = [s for stage in stages for s in global_steps(CHAIN, stage)]
    ref = reference_run(CHAIN, steps, ckpts / CHAIN.family) if steps else None
    error = next((r["error"] for r in ranks if r["error"]), None)
    return stages, ref, error


@pytest.mark.parametrize(
    "stage",
    range(len(CHAIN_STAGES)),
    ids=[f"{i}-{label}-from-{CHAIN_STAGES[i - 1][0] if i else 'hf'}" for i, (label, *_) in enumerate(CHAIN_STAGES)],
)
def test_resume_chain_losses_equal_transformers(chain, stage):
    """Each stage resumed the previous one's checkpoint (model and optimiser, strictly) with other expert-parallel
    settings (no EP -> EP 2 -> EP 4 -> EP 2 whole -> gathered `torch` file -> EP 2 sharded with CPU offload ->
    `torch` file -> EP 2 whole with CPU offload -> no EP): its per-step losses equal one uninterrupted Transformers
    run over the same global batches."""
    stages, ref, error = chain
    assert stage < len(stages), f"stage {stage} did not run: {error}"
    steps_done = CHAIN_STAGES[stage][2]
    first = CHAIN_STAGES[stage - 1][2] if stage else 0
    assert [len(global_steps(CHAIN, s)) for s in stages[stage : stage + 1]] == [steps_done - first]
    start = sum(len(global_losses(s)) for s in stages[:stage])
    losses = global_losses(stages[stage])
    errors = relative_errors(losses, ref.losses[start : start + len(losses)])
    assert max(errors) < FP32_LOSS, f"stage {stage}: per-step relative loss errors {errors}"


def test_resume_chain_final_gathered_checkpoint_equals_transformers(runs, chain):
    """The `torch` files of the EP 2 stages (whole experts; FSDP-sharded with CPU offload) hold all experts and their
    AdamW moments, gathered; the last stage's (no EP, resumed from EP 2) weights equal the reference's after every
    step."""
    out, _ = runs
    stages, ref, error = chain
    assert len(stages) == len(CHAIN_STAGES), error
    for stage, (_, _, _, fmt) in enumerate(CHAIN_STAGES):
        if fmt != "torch":
            continue
        path = chain_checkpoint(out, stage)
        assert path.is_file()
        whole = torch.load(path, weights_only=True)
        saved = whole["state_dict"]
        experts = [k for k in saved if ".mlp.experts." in k]
        assert experts and all(saved[k].shape[0] == 8 for k in experts)  # all 8 experts, not a rank's share
        optim = whole["optimizer_states"][0]
        recorded = whole["lightning_mm"]["optimizer_param_names"][0]  # the names of the indices, per group
        names = {
            i: n for g, fqns in zip(optim["param_groups"], recorded, strict=True) for i, n in zip(g["params"], fqns)
        }
        moments = [
            v
            for i, s in optim["state"].items()
            if ".mlp.experts." in names[i]
            for k, v in s.items()
            if k in ("exp_avg", "exp_avg_sq")
        ]
        assert len(moments) == 2 * len(experts) and all(m.shape[0] == 8 for m in moments)
    final = {k.removeprefix("model."): v for k, v in saved.items()}
    worst = max(weight_errors(final, ref).items(), key=lambda kv: kv[1])
    assert worst[1] <= FP32_WEIGHTS, f"final weights differ from the reference: {worst}"


def test_cpu_offload_covers_the_experts(chain):
    """`offload_to_cpu: true` with EP: FSDP offloads the local experts too, the FSDP-sharded ones over ep_replicate
    and the whole ones (`reshard_local_experts: false`) as a unit of their rank alone; without offload, whole local
    experts stay out of FSDP."""
    stages, _, error = chain
    assert len(stages) == len(CHAIN_STAGES), error
    for (label, fsdp2, _, _), stage in zip(CHAIN_STAGES, stages):
        if not fsdp2:
            continue
        whole = not fsdp2["reshard_local_experts"]
        replicas = DEVICES // fsdp2["expert_parallel_size"]
        if fsdp2.get("offload_to_cpu"):
            expected = {"fsdp_mesh": 1 if whole else replicas, "offload": "CPUOffloadPolicy", "device": "cpu"}
        elif whole:
            expected = {"fsdp_mesh": None, "offload": None, "device": "cpu"}
        else:
            expected = {"fsdp_mesh": replicas, "offload": "OffloadPolicy", "device": "cpu"}
        for r, rank in enumerate(stage):
            assert rank["experts"] == [expected] * 2, (label, r, rank["experts"])


def test_ep2_checkpoint_converts_to_transformers_layout(runs, chain, tmp_path):
    import transformers

    from lightning_mm.hf.dcp_conversion import dcp_to_hf

    out, ckpts = runs
    stages, _, error = chain
    assert len(stages) > 1, error
    assert CHAIN_STAGES[1][0] == "ep2" and CHAIN_STAGES[1][3] == "torch_dcp"
    hf_dir = dcp_to_hf(chain_checkpoint(out, 1), tmp_path / "hf")
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    steps = [s for stage in stages[:2] for s in global_steps(CHAIN, stage)]
    ref = reference_run(CHAIN, steps, ckpts / CHAIN.family)  # the 3 steps before the EP 2 stage saved
    state = dict(model.named_parameters())
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # all experts, fused as Transformers has
    errors = {n: float((state[n].detach() - t).norm() / t.norm()) for n, t in ref.final.items()}
    worst = max(errors.items(), key=lambda kv: kv[1])
    assert worst[1] <= FP32_WEIGHTS, f"converted weights differ from the reference after 3 steps: {worst}"


def test_rank_whose_experts_get_no_token_takes_part_in_backward(runs):
    """No token routed to the last rank's experts: the launch finishes (it deadlocked) and results are exact."""
    from tests.scenarios.ep_scenarios import IDLE_RANK

    ranks = [r["parts"][0] for r in _ranks(runs[0], IDLE_RANK.name)]
    for r, data in enumerate(ranks):
        assert data["out"] < 1e-6 and data["x_grad"] < 1e-6 and data["w_grad"] < 1e-6, (r, data)
        assert data["expert_grads"] < 1e-5, (r, data)
    assert ranks[-1]["idle_expert_grads"] == 0.0


# --------------------------------------------------------------------------------- in one process
def _regroup_run(groups: list[list[int]], lrs: list[float]) -> tuple[torch.nn.Module, Any, Any]:
    """A small net whose parameters are split into ``groups`` (indices into its parameter list), with a LambdaLR."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(net.parameters())
    opt = torch.optim.AdamW([{"params": [params[i] for i in g], "lr": lr} for g, lr in zip(groups, lrs)])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return net, opt, sched


def test_optimizer_state_loads_into_parameters_grouped_differently(tmp_path):
    """Expert parallelism's whole local experts (plain tensors) are an optimiser group of their own, FSDP-sharded
    ones are not: a checkpoint whose groups split the same parameters differently, with the same hyper-parameters,
    loads strictly (state by parameter name, the scheduler's per-group lists regrouped); other hyper-parameters
    are refused."""
    from lightning_mm.checkpoint import CheckpointKeyError, store

    net, opt, sched = _regroup_run([[0, 1, 2, 3]], [0.1])
    for _ in range(3):
        net(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    extra = {
        "format_version": 1,
        "kind": "training",
        "world_size": 1,
        "rng_point": "next_batch",
        "hf": [],
        # what the strategy records beside a `torch` file's index-keyed optimizer state
        "optimizer_param_names": store.optimizer_param_names(net, [opt]),
    }
    state = {
        "epoch": 0,
        "global_step": 3,
        "state_dict": net.state_dict(),
        "optimizer_states": [store.optimizer_state(net, opt, full=True)],
        "lr_schedulers": [sched.state_dict()],
    }
    store.save(state, tmp_path / "one_group.ckpt", "torch", extra, None)

    fresh, fresh_opt, fresh_sched = _regroup_run([[0, 1], [3, 2]], [0.1, 0.1])  # as an EP run might group them
    loaded = store.load(
        tmp_path / "one_group.ckpt",
        fresh,
        [fresh_opt],
        strict=True,
        rank=0,
        world_size=1,
        fitting=True,
        schedulers=[fresh_sched],
    )
    fresh_sched.load_state_dict(loaded.checkpoint["lr_schedulers"][0])
    names = dict(net.named_parameters())
    for group in fresh_opt.param_groups:
        assert group["lr"] == opt.param_groups[0]["lr"] and group["initial_lr"] == 0.1
        for p in group["params"]:
            name = next(n for n, q in fresh.named_parameters() if q is p)
            for key, value in opt.state[names[name]].items():
                assert torch.equal(fresh_opt.state[p][key], value), (name, key)
    assert fresh_sched.base_lrs == [0.1, 0.1] and len(fresh_sched.get_last_lr()) == 2
    fresh_sched.step()
    assert [g["lr"] for g in fresh_opt.param_groups] == pytest.approx([0.1 / 5] * 2)  # the 4th step's factor

    other, other_opt, other_sched = _regroup_run([[0, 1], [2, 3]], [0.1, 0.2])  # two learning rates: no merging
    state["optimizer_states"] = [store.optimizer_state(other, other_opt, full=True)]
    state["lr_schedulers"] = [other_sched.state_dict()]
    extra["optimizer_param_names"] = store.optimizer_param_names(other, [other_opt])
    store.save(state, tmp_path / "two_lrs.ckpt", "torch", extra, None)
    single, single_opt, single_sched = _regroup_run([[0, 1, 2, 3]], [0.1])
    with pytest.raises(CheckpointKeyError, match="1 parameter group"):
        store.load(
            tmp_path / "two_lrs.ckpt",
            single,
            [single_opt],
            strict=True,
            rank=0,
            world_size=1,
            fitting=True,
            schedulers=[single_sched],
        )


def test_nested_scheduler_states_are_regrouped_but_not_their_milestones():
    """SequentialLR keeps its schedulers' states (with per-group lists) and its milestones (not per group)."""
    from lightning_mm.checkpoint.regroup import remap_scheduler

    def sequential(groups: int) -> Any:
        opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=0.1)
        first = torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=1)
        return torch.optim.lr_scheduler.SequentialLR(
            opt, [first, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)], milestones=[1]
        )

    one = sequential(1)
    for _ in range(3):
        one.optimizer.step()
        one.step()
    state = remap_scheduler(one.state_dict(), [0, 0], 1)
    assert state["_milestones"] == [1] and all(len(s["base_lrs"]) == 2 for s in state["_schedulers"])
    two = sequential(2)
    two.load_state_dict(state)
    for group in two.optimizer.param_groups:  # restored with the optimiser's state
        group["lr"] = one.optimizer.param_groups[0]["lr"]
    two.optimizer.step()
    two.step()
    one.optimizer.step()
    one.step()
    assert [g["lr"] for g in two.optimizer.param_groups] == pytest.approx([one.optimizer.param_groups[0]["lr"]] * 2)


# ---------------------------------------------------------------------------------------------------------------
# A custom MoE model's own dispatch (FSDP2Mixin.expert_parallel_forward) and a training step in which some ranks'
# experts receive no token (tests/scenarios/ep_custom_scenarios.py; same launch).
@pytest.mark.parametrize("name", ["custom_moe-ep2", "custom_moe-ep2-whole"])
def test_custom_moe_dispatch_hook_trains_as_one_process_without_ep(runs, name):
    from tests.scenarios.ep_custom_scenarios import CUSTOM_CASES, LAYERS, custom_reference

    case = {c.name: c for c in CUSTOM_CASES}[name]
    ranks = [r["parts"][0] for r in _ranks(runs[0], name)]
    for data in ranks:  # the hook served every MoE module, each rank holding half of the 4 experts
        assert data["hook_calls"] == [f"blocks.{i}.experts" for i in range(LAYERS)], data["hook_calls"]
        assert data["local_experts"] == [2] * LAYERS
    steps = global_steps(case, ranks)
    assert len(steps) == case.steps and all(len(group) == DEVICES for micro in steps for group in micro)
    errors = relative_errors(global_losses(ranks), custom_reference(steps))
    assert max(errors) < FP32_LOSS, f"{name}: per-step relative loss errors {errors}"


def test_training_with_ranks_whose_experts_get_no_token(runs):
    """All routers zero: every token picks the same two experts, so in the first step two of the four EP ranks
    receive no token in every MoE layer. The launch finishes (a rank skipping the all-to-all's backward
    deadlocked against FSDP's reduce-scatter) and the losses equal one-process Transformers'."""
    from tests.scenarios.ep_custom_scenarios import ZERO_ROUTER

    out, _ = runs
    case = ZERO_ROUTER
    ranks = [r["parts"][0] for r in _ranks(out, case.name)]
    per_rank = 8 // 4
    for layer in range(2):
        picked = {e for data in ranks for e in data["chosen_experts"][layer]}
        idle = [r for r in range(DEVICES) if not picked & set(range(r * per_rank, (r + 1) * per_rank))]
        assert idle, f"layer {layer}: every rank's experts got tokens ({sorted(picked)}); the case tests nothing"
    steps = global_steps(case, ranks)
    assert len(steps) == case.steps
    ref = reference_run(case, steps, out / "zero_router_ckpt" / case.family)
    errors = relative_errors(global_losses(ranks), ref.losses)
    assert max(errors) < FP32_LOSS, f"per-step relative loss errors {errors}"


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("routing", ["idle", "busy"])
def test_routed_forward_with_each_transformers_experts_kernel(runs, impl, routing):
    """The routed forward and backward equal the unsplit experts module's with each of Transformers' experts
    implementations, with a rank whose experts get no token ("idle") and without ("busy")."""
    from tests.scenarios.ep_custom_scenarios import ROUTED_KERNELS

    for r, data in enumerate(_ranks(runs[0], ROUTED_KERNELS.name)):
        result = data["parts"][0][f"{impl}-{routing}"]
        assert result["finite"], (r, result)
        assert result["out"] < 1e-6 and result["x_grad"] < 1e-6 and result["w_grad"] < 1e-6, (r, result)
        assert result["expert_grads"] < 1e-5, (r, result)


@pytest.mark.parametrize("name", ["qwen3_moe-hub-layout-ep2", "qwen3_moe-hub-layout-ep4-whole"])
def test_hub_layout_per_expert_weights_load_sliced_under_ep(runs, name):
    """Qwen3-MoE stored one tensor per expert (its Hub layout): each rank reads only its own experts' pieces (2 of 8
    per layer on 4 ranks, every piece read by exactly one rank), and training equals one-process Transformers'
    `from_pretrained` of the same files."""
    import re

    from tests.scenarios.ep_custom_scenarios import HUB_LAYOUT_CASES

    out, _ = runs
    case = {c.name: c for c in HUB_LAYOUT_CASES}[name]
    ranks = [r["parts"][0] for r in _ranks(out, name)]
    owners: dict[tuple[int, int], int] = {}
    for r, data in enumerate(ranks):
        per_layer: dict[int, set[int]] = {}
        pieces: dict[tuple[int, int], list[str]] = {}
        for key, offsets, _sizes in data["expert_reads"]:
            found = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", key)
            assert found is not None, key
            layer, expert = int(found.group(1)), int(found.group(2))
            assert offsets == [0, 0], (key, offsets)  # whole pieces: the experts are split, not their rows
            per_layer.setdefault(layer, set()).add(expert)
            pieces.setdefault((layer, expert), []).append(found.group(3))
        assert sorted(per_layer) == [0, 1] and all(len(e) == 2 for e in per_layer.values()), (r, per_layer)
        for where, kinds in pieces.items():
            assert sorted(kinds) == ["down", "gate", "up"], (r, where, kinds)
            assert where not in owners, f"expert {where} read by ranks {owners[where]} and {r}"
            owners[where] = r
    assert sorted(owners) == [(layer, e) for layer in range(2) for e in range(8)]
    steps = global_steps(case, ranks)
    assert len(steps) == case.steps
    ref = reference_run(case, steps, out / "hub_layout_ckpt" / case.family)
    errors = relative_errors(global_losses(ranks), ref.losses)
    assert max(errors) < FP32_LOSS, f"{name}: per-step relative loss errors {errors}"
