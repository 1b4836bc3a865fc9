"""Token-budget batches (issue #25): the batch plan in-process; training on 2 and 4 gloo ranks
(``tests/packing_scenarios.py``): the same steps on every rank in every epoch, mid-epoch resume exact, also after
a change of world size."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_mm.core.token_budget import RankSchedule, TokenBudgetError, batch_cost, plan_batches
from tests import packing_scenarios
from tests.packing_scenarios import BUFFER, EPOCHS, MAX_TOKENS, RESUME_STEP, SAMPLES, SEED, skewed_lengths
from tests.scenario_kit import read_results, run


def _plan(epoch: int) -> list[list[int]]:
    return plan_batches(skewed_lengths(), MAX_TOKENS, BUFFER, SEED, epoch)


@pytest.mark.parametrize("packing", [True, False])
def test_plan_is_deterministic_within_budget_and_covers_every_sample_once(packing: bool) -> None:
    lengths = skewed_lengths()
    plan = plan_batches(lengths, MAX_TOKENS, BUFFER, SEED, 0, packing=packing)
    assert plan == plan_batches(lengths, MAX_TOKENS, BUFFER, SEED, 0, packing=packing)
    assert plan != plan_batches(lengths, MAX_TOKENS, BUFFER, SEED, 1, packing=packing)  # reshuffled per epoch
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    assert all(batch_cost([lengths[i] for i in batch], packing) <= MAX_TOKENS for batch in plan)
    assert max(batch_cost([lengths[i] for i in b], packing) for b in plan) > MAX_TOKENS // 2  # bins are filled


def test_plan_refuses_a_sample_longer_than_the_budget() -> None:
    with pytest.raises(TokenBudgetError, match=r"sample 1 has 9 tokens"):
        plan_batches([3, 9, 2], 8, 4, 0, 0)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batches", [13, 14, 15])
def test_every_rank_runs_the_same_steps_and_a_resume_continues_on_any_world_size(world: int, batches: int) -> None:
    steps = {RankSchedule(batches, world, rank).steps for rank in range(world)}
    assert steps == {math.ceil(batches / world)}
    dealt = sorted(i for rank in range(world) for i in RankSchedule(batches, world, rank).batch_indices())
    assert set(dealt) == set(range(batches))  # all of them; the last step repeats the first ones
    consumed = 2 * 3  # 3 steps on 2 ranks, then resumed on `world`
    rest = sorted(i for r in range(world) for i in RankSchedule(batches, world, r, start=consumed).batch_indices())
    extra = len(rest) - (batches - consumed)  # the last step's repeats: the epoch's first batches
    assert 0 <= extra < world and rest == sorted([*range(consumed, batches), *range(extra)])


def _steps_per_epoch(ranks: list[dict], key: str) -> list[list[int]]:
    return [[sum(1 for s in rank[key] if s["epoch"] == epoch) for rank in ranks] for epoch in range(EPOCHS)]


def test_token_budget_training_on_2_and_4_ranks(tmp_path: Path) -> None:
    """Also: a packed row split over 2 context-parallel ranks equals plain Transformers on the padded samples."""
    import torch

    from lightning_mm.hf.chat_collate import ChatCollator
    from tests.test_packing import _assert_grads_equal, _close, _run, plain_model, samples_of

    reference = plain_model("qwen3")
    reference.save_pretrained(tmp_path / "qwen3")  # for the context-parallel step
    run(packing_scenarios.two, tmp_path, timeout=420)
    cp = torch.load(tmp_path / "cp.pt", weights_only=True)
    ref_loss, _, ref_grads = _run(reference.train(), ChatCollator(pad_token_id=0)(samples_of("qwen3")))
    assert _close(cp["loss"], ref_loss), (float(cp["loss"]), float(ref_loss))
    _assert_grads_equal(cp["grads"], ref_grads)

    two = read_results(tmp_path, "two", 2)
    plans = [_plan(epoch) for epoch in range(EPOCHS)]
    for epoch, plan in enumerate(plans):  # the same steps on both ranks, as the plan says, all samples seen
        assert _steps_per_epoch(two, "full")[epoch] == [math.ceil(len(plan) / 2)] * 2
        for r, rank in enumerate(two):
            rows = [s["samples"] for s in rank["full"] if s["epoch"] == epoch]
            assert rows == [plan[i] for i in RankSchedule(len(plan), 2, r).batch_indices()]
        seen = {i for rank in two for s in rank["full"] if s["epoch"] == epoch for i in s["samples"]}
        assert seen == set(range(SAMPLES))
    assert all(s["tokens"] <= MAX_TOKENS for rank in two for s in rank["full"])
    for rank in two:  # mid-epoch resume: the same batches and the same losses, exactly
        assert rank["resumed"] == rank["full"][RESUME_STEP:]

    run(packing_scenarios.four, tmp_path, timeout=420)  # resumes tmp_path/ckpt
    four = read_results(tmp_path, "four", 4)
    assert _steps_per_epoch(four, "resumed")[1] == [math.ceil(len(plans[1]) / 4)] * 4  # a whole epoch on 4 ranks
    # The 2-rank checkpoint (3 steps: 6 global batches) resumed on 4 ranks: the next unseen batches of epoch 0.
    for r, rank in enumerate(four):
        want = [plans[0][i] for i in RankSchedule(len(plans[0]), 4, r, start=2 * RESUME_STEP).batch_indices()]
        want += [plans[1][i] for i in RankSchedule(len(plans[1]), 4, r).batch_indices()]
        assert [s["samples"] for s in rank["resumed"]] == want
    assert len({len(rank["resumed"]) for rank in four}) == 1
