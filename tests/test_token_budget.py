"""Token-budget batches (issue #25): the batch plan in-process; training on 2 and 4 gloo ranks
(``tests/scenarios/packing_scenarios.py``): the same steps on every rank in every epoch, mid-epoch resume exact, also
after a change of world size."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_mm.core.token_budget_plan import RankSchedule, TokenBudgetError, batch_cost, plan_batches
from lightning_mm.data.replacing import ReplacingDataset
from lightning_mm.datamodules.token_budget_loader import TokenBudgetLoader, vocab_size_of
from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import packing_scenarios
from tests.scenarios.packing_scenarios import BUFFER, EPOCHS, MAX_TOKENS, RESUME_STEP, SAMPLES, SEED, skewed_lengths


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


class _Ids(torch.utils.data.Dataset):
    """Samples of the given ``input_ids``; ``sample_lengths()`` says ``reported`` (default: the real lengths)."""

    def __init__(self, ids: list, reported: list[int] | None = None) -> None:
        self.ids, self.reported = ids, reported

    def __len__(self) -> int:
        return len(self.ids)

    def sample_lengths(self) -> list[int]:
        return self.reported if self.reported is not None else [len(i) for i in self.ids]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def _loader(data: torch.utils.data.Dataset, max_tokens: int = 8, **kwargs: object) -> TokenBudgetLoader:
    options: dict = dict(buffer_size=4, seed=0, shuffle=False, packing=True, drop_last=False, world_size=1, rank=0)
    options.update(kwargs)
    return TokenBudgetLoader(data, data.sample_lengths(), max_tokens, collate_fn=lambda b: b, **options)  # type: ignore[attr-defined]


def test_an_empty_dataset_or_no_step_is_an_error() -> None:
    with pytest.raises(TokenBudgetError, match="no sample"):
        _loader(_Ids([]))
    with pytest.raises(TokenBudgetError, match="1 token-budget batch.*fewer than the 2 data-parallel ranks"):
        _loader(_Ids([[1, 2]]), drop_last=True, world_size=2)


@pytest.mark.parametrize(
    "ids, vocab, message",
    [
        ([1.0, 2.5, 3.0], None, "sample 1: input_ids must be integer token ids, got torch.float32"),
        (torch.tensor([1.0, 2.0]), None, "sample 1: input_ids must be integer token ids, got torch.float32"),
        ([1, -5, 3], None, "sample 1: token id -5 is negative"),
        ([1, 40, 3], 32, "sample 1: token id 40 is outside the vocabulary of 32"),
        ([True, False], None, "sample 1: input_ids must be integer token ids, got torch.bool"),
    ],
)
def test_token_ids_must_be_integers_in_the_vocabulary(ids: object, vocab: int | None, message: str) -> None:
    data = _Ids([[4, 5], ids, [6]])
    loader = _loader(data, **({"vocab_size": vocab} if vocab else {}))
    with pytest.raises(TokenBudgetError, match=message.replace("(", r"\(")):
        list(loader)
    assert list(_loader(_Ids([[4, 5], [31, 0], [6]]), vocab_size=32))  # in range: fine


def test_the_vocabulary_is_the_model_input_embeddings() -> None:
    """A LightningModule's Transformers model (a tiny Qwen3): its input embeddings' rows."""
    from tests.test_packing import plain_model

    module = torch.nn.Module()
    module.model = plain_model("qwen3")
    assert vocab_size_of(_Ids([[1]]), module) == module.model.config.vocab_size
    assert vocab_size_of(_Ids([[1]]), None) is None


@pytest.mark.parametrize("bad", [2.5, -1.0, "3", True])
def test_sample_lengths_must_be_token_counts(bad: object) -> None:
    from lightning_mm.datamodules.token_budget_loader import sample_lengths

    with pytest.raises(TokenBudgetError, match=r"sample_lengths\(\) gave .* for sample 1"):
        sample_lengths(_Ids([[1], [2, 3]], reported=[1, bad]))  # type: ignore[list-item]


def test_an_under_reported_length_is_an_error_naming_the_sample() -> None:
    """Sample 2 has 5 tokens but sample_lengths() says 2: the plan packs it with samples 0 and 1 (2 + 3 + 2 <= 8);
    the row would hold 10 tokens."""
    data = _Ids([[1, 2], [1, 2, 3], [1, 2, 3, 4, 5]], reported=[2, 3, 2])
    with pytest.raises(TokenBudgetError, match=r"sample 2 has 5 tokens but its length was given as 2"):
        list(_loader(data))


class _Flaky(ReplacingDataset):
    """Records are token counts; the records in ``broken`` fail to load (replaced by the next good one)."""

    def __init__(self, lengths: list[int], broken: set[int]) -> None:
        super().__init__(list(range(len(lengths))))
        self.lengths, self.broken = lengths, broken

    def sample_lengths(self) -> list[int]:
        return list(self.lengths)

    def where(self, record: int) -> str:
        return f"record {record}"

    def sample(self, record: int) -> dict:
        if record in self.broken:
            raise OSError("cannot decode")
        return {"input_ids": [record] * self.lengths[record]}


def test_a_replacement_record_keeps_the_row_within_the_budget() -> None:
    """Record 0 (2 tokens) fails; the next record (1, 6 tokens) would make its row 2 + 6 > 7 with record 2: the
    replacement is the next record no longer than 2 tokens (3)."""
    data = _Flaky([2, 6, 5, 1, 4], broken={0})
    with pytest.warns(UserWarning, match="record 0"):
        rows = list(_loader(data, max_tokens=7))
    for row in rows:
        assert sum(len(s["input_ids"]) for s in row) <= 7
    assert [3] in [s["input_ids"] for row in rows for s in row]  # record 3 took record 0's place
    # Every other record is longer than the failed one and the row overflows: an error naming the sample.
    data = _Flaky([1, 7, 6, 7], broken={0})
    with pytest.warns(UserWarning), pytest.raises(TokenBudgetError, match=r"sample 0 was replaced by a longer"):
        list(_loader(data, max_tokens=7))


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


def test_ranks_whose_plans_differ_fail_before_the_first_step(tmp_path: Path) -> None:
    """Rank 1's dataset has one sample fewer, then none: both ranks get the error naming each rank's counts (or rank
    1's planning error) before any step (not a collective that waits out the process-group timeout, nor ranks
    running different numbers of steps)."""
    for case in ("fewer", "empty"):
        run(packing_scenarios.mismatch, tmp_path / case, args={"case": case}, timeout=240)
    short = plan_batches(skewed_lengths(SAMPLES - 1), MAX_TOKENS, BUFFER, SEED, 0)
    for fewer, empty in zip(read_results(tmp_path / "fewer", "mismatch"), read_results(tmp_path / "empty", "mismatch")):
        assert fewer["error"] is not None and empty["error"] is not None, (fewer, empty)
        assert f"rank 0: {len(_plan(0))} batches from {SAMPLES} samples" in fewer["error"]
        assert f"rank 1: {len(short)} batches from {SAMPLES - 1} samples" in fewer["error"]
        assert "rank 1: the training dataset has no sample" in empty["error"]
        assert fewer["seconds"] < 120 and empty["seconds"] < 120


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
