"""The training DataLoader of token-budget batches (``MMDataModule(max_tokens_per_rank=...)``).

The epoch's batches come from :func:`~lightning_mm.core.token_budget_plan.plan_batches` (the same list on every rank,
from the samples' lengths) and are dealt to the data-parallel ranks by
:class:`~lightning_mm.core.token_budget_plan.RankSchedule`: every rank runs the same number of steps, known before the
epoch. At the start of each epoch the ranks compare their plans with one small collective (an all-gather of the
batch count, the steps and a digest of the plan and of the lengths it came from): ranks whose datasets differ get a
:class:`~lightning_mm.core.token_budget_plan.TokenBudgetError` naming every rank's counts, on every rank, before the
first step, instead of a collective that waits for a step another rank never runs.

Each batch is checked as it is built (:func:`~lightning_mm.core.token_budget_plan.check_token_ids`,
:func:`~lightning_mm.core.token_budget_plan.check_batch`): token ids are integers in ``[0, vocab_size)``, no sample is
longer than its planned length (a ``sample_lengths()`` that under-reports is an error naming the sample), and a
record that replaces one that failed to load (:mod:`lightning_mm.data.replacing`, which picks one no longer
than the failed one when it can) keeps the batch within the budget, else an error naming the sample.

The loader is an iterable-style one (Lightning adds no sampler to it: the plan already
splits the data between the ranks); with workers, worker ``w`` loads steps ``w, w + workers, ...`` and the
DataLoader returns them in order.

Mid-epoch resume: the loader's state (Lightning's stateful-loader interface, saved in the checkpoint) is the
epoch, the global batches consumed and a fingerprint of the plan; a resumed run starts at the next unseen global
batch without loading the skipped ones, also with another number of data-parallel ranks (see
:mod:`lightning_mm.core.token_budget_plan`). A checkpoint whose plan differs (other lengths, seed, budget, buffer or
packing) is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from lightning_mm.core.token_budget_plan import (
    RankSchedule,
    TokenBudgetError,
    check_batch,
    check_token_ids,
    plan_batches,
    plan_digest,
    plan_fingerprint,
)
from lightning_mm.data.replacing import ReplacingDataset

__all__ = ["TokenBudgetLoader", "sample_lengths", "vocab_size_of"]


def vocab_size_of(dataset: Dataset, module: Any = None) -> int | None:
    """The vocabulary token ids are checked against: ``dataset.vocab_size`` when it has one, else the input
    embeddings of the LightningModule's model (``get_input_embeddings()``, Transformers' accessor, on the module or
    its ``model``), else ``None`` (ids are then only checked to be non-negative integers)."""
    own = getattr(dataset, "vocab_size", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own
    for holder in (module, getattr(module, "model", None)):
        get = getattr(holder, "get_input_embeddings", None)
        if callable(get):
            try:
                embeddings = get()
            except (AttributeError, NotImplementedError):
                continue
            weight = getattr(embeddings, "weight", None)
            if weight is not None and getattr(weight, "ndim", 0) == 2:
                return int(weight.shape[0])
    return None


def sample_lengths(dataset: Dataset) -> list[int]:
    """Every sample's token count: ``dataset.sample_lengths()`` when the dataset defines it, else by loading each
    sample once and counting its ``input_ids``."""
    own = getattr(dataset, "sample_lengths", None)
    if callable(own):
        lengths = []
        for index, n in enumerate(own()):
            if isinstance(n, bool) or not isinstance(n, (int, torch.Tensor, np.integer)) or int(n) != n:
                raise TokenBudgetError(f"sample_lengths() gave {n!r} for sample {index}: lengths are token counts")
            lengths.append(int(n))
    else:
        lengths = []
        for index in range(len(dataset)):  # type: ignore[arg-type]
            sample = dataset[index]
            if not isinstance(sample, dict) or "input_ids" not in sample:
                raise TokenBudgetError(
                    f"token-budget batches need samples with `input_ids` (sample {index} is a "
                    f"{type(sample).__name__}), or a dataset with sample_lengths()"
                )
            lengths.append(len(sample["input_ids"]))
    if len(lengths) != len(dataset):  # type: ignore[arg-type]
        raise TokenBudgetError(f"sample_lengths() gave {len(lengths)} lengths for {len(dataset)} samples")  # type: ignore[arg-type]
    return lengths


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _PlannedBatches(IterableDataset):
    """Yields the lists of samples of one rank's planned batches (the loader's collate function batches them),
    each checked against the plan and the budget as it is built."""

    def __init__(
        self, dataset: Dataset, lengths: list[int], max_tokens: int, packing: bool, vocab_size: int | None
    ) -> None:
        self.dataset = dataset
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.packing = packing
        self.vocab_size = vocab_size
        self.plan: list[list[int]] = []
        self.indices: list[int] = []  # this rank's global batch indices, step by step (set for each epoch)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[list[Any]]:
        plan, indices = self.plan, self.indices
        info = get_worker_info()
        for step, batch in enumerate(indices):
            if info is not None and step % info.num_workers != info.id:
                continue
            yield self.build(plan[batch])

    def build(self, indices: list[int]) -> list[Any]:
        """The samples of one planned batch, checked (see the module docstring)."""
        samples = [self.dataset[i] for i in indices]
        actual = []
        for index, sample in zip(indices, samples):
            if not isinstance(sample, dict) or "input_ids" not in sample:
                raise TokenBudgetError(
                    f"sample {index}: token-budget batches need samples with `input_ids`, got {type(sample).__name__}"
                )
            actual.append(check_token_ids(sample["input_ids"], index, self.vocab_size))
        replaced = [i for i in indices if i in self.dataset.bad] if isinstance(self.dataset, ReplacingDataset) else []
        planned = [self.lengths[i] for i in indices]
        check_batch(indices, planned, actual, self.max_tokens, self.packing, replaced)
        return samples


class TokenBudgetLoader(DataLoader):
    """Batches of at most ``max_tokens`` tokens (packed: their sum; padded: rows x longest) for one rank."""

    def __init__(
        self,
        dataset: Dataset,
        lengths: Sequence[int],
        max_tokens: int,
        buffer_size: int,
        seed: int,
        shuffle: bool,
        packing: bool,
        drop_last: bool,
        world_size: int,
        rank: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        epoch_fn: Callable[[], int] = lambda: 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        self.lengths = list(lengths)
        self.max_tokens = max_tokens
        self.buffer_size = buffer_size
        self.seed = seed
        self.shuffle = shuffle
        self.packing = packing
        self.world_size = world_size
        self.rank = rank
        self._drop_last = drop_last
        self._epoch_fn = epoch_fn
        self._fingerprint = plan_fingerprint(self.lengths, max_tokens, buffer_size, seed, packing, shuffle)
        self._plans: dict[int, list[list[int]]] = {}
        self._start = 0  # global batches of the epoch already consumed (set on resume)
        self._resume_epoch: int | None = None
        self._epoch = 0
        self._steps_run = 0
        self._steps_before_run = 0
        self._iter_epoch: int | None = None
        self._iter_len = 0
        self._consumed_before = 0
        self._steps_before = 0  # steps of the epoch run before the checkpoint (Lightning counts on from there)
        self._plan_error: str | None = None
        try:
            self._check_plan(0)  # fails now, naming a sample longer than the budget, or an empty dataset
        except TokenBudgetError as err:
            if not _distributed():
                raise
            # Raised on every rank at the epoch's start (_check_ranks_agree): raised here, on this rank only, it
            # would leave the others waiting in the next collective (Lightning's, on the loaders' lengths).
            self._plan_error = str(err)
        limit = getattr(dataset, "limit_replacements", None)
        if callable(limit):
            limit(self.lengths)  # a record that fails to load is replaced by one no longer than it
        super().__init__(
            _PlannedBatches(dataset, self.lengths, max_tokens, packing, vocab_size),
            batch_size=None,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )

    def _check_plan(self, epoch: int) -> None:
        if self.schedule(epoch).steps == 0:
            raise TokenBudgetError(
                f"the training data make {len(self.plan(epoch))} token-budget batch(es), fewer than the "
                f"{self.world_size} data-parallel ranks: with drop_last no step would run"
            )

    def plan(self, epoch: int) -> list[list[int]]:
        """The epoch's global batch plan (the same on every rank)."""
        if epoch not in self._plans:
            self._plans = {
                epoch: plan_batches(
                    self.lengths, self.max_tokens, self.buffer_size, self.seed, epoch, self.shuffle, self.packing
                )
            }
        return self._plans[epoch]

    def schedule(self, epoch: int | None = None) -> RankSchedule:
        epoch = self._epoch_fn() if epoch is None else epoch
        start = self._start if self._resume_epoch == epoch else 0
        return RankSchedule(len(self.plan(epoch)), self.world_size, self.rank, self._drop_last, start)

    def __len__(self) -> int:
        """The epoch's steps on every rank: those run before a resume plus those left."""
        if self._plan_error is not None:
            return 1  # not 0 (Lightning would fail this rank alone): the error comes on every rank at the epoch's start
        epoch = self._epoch_fn()
        if self._resume_epoch == epoch:
            return self._steps_before + self.schedule(epoch).steps
        if self._iter_epoch == epoch:
            return self._iter_len
        return self.schedule(epoch).steps

    # A generator rather than DataLoader's _BaseDataLoaderIter: its callers (Lightning, a for loop) only iterate.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        epoch = self._epoch_fn()
        self._check_ranks_agree(epoch)
        resumed = self._resume_epoch == epoch
        schedule = self.schedule(epoch)
        self._iter_len = len(self)
        batches = cast(_PlannedBatches, self.dataset)  # set in __init__; DataLoader forbids replacing it
        batches.plan, batches.indices = self.plan(epoch), schedule.batch_indices()
        self._epoch, self._iter_epoch = epoch, epoch
        self._consumed_before = schedule.start
        self._steps_before_run = self._steps_before if resumed else 0
        self._steps_run = 0
        self._resume_epoch, self._start, self._steps_before = None, 0, 0
        for batch in super().__iter__():
            self._steps_run += 1
            yield batch

    def _check_ranks_agree(self, epoch: int) -> None:
        """One all-gather at the epoch's start: every rank planned the same batches from the same lengths, and runs
        the same steps from the same position; else TokenBudgetError on every rank, naming each rank's counts (or
        the error a rank's plan met)."""
        mine: Any
        try:
            if self._plan_error is not None:
                raise TokenBudgetError(self._plan_error)
            self._check_plan(epoch)
            plan, schedule = self.plan(epoch), self.schedule(epoch)
            mine = (len(plan), schedule.steps, schedule.start, len(self.lengths), plan_digest(plan, self._fingerprint))
        except TokenBudgetError as err:
            if not _distributed():
                raise
            mine = str(err)
        if not _distributed():
            return
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        failed = [f"rank {r}: {theirs}" for r, theirs in enumerate(everyone) if isinstance(theirs, str)]
        if failed:
            raise TokenBudgetError(f"token-budget batches cannot be planned on every rank ({'; '.join(failed)})")
        if all(tuple(theirs) == mine for theirs in everyone):
            return
        counts = "; ".join(
            f"rank {r}: {n} batches from {samples} samples, {steps} steps from batch {start}"
            for r, (n, steps, start, samples, _) in enumerate(everyone)
        )
        same_counts = len({tuple(theirs)[:4] for theirs in everyone}) == 1
        raise TokenBudgetError(
            f"the ranks' token-budget batch plans for epoch {epoch} differ ({counts}"
            f"{'; the batches differ' if same_counts else ''}): every rank must load the same training data "
            "(samples and lengths) with the same seed, max_tokens_per_rank, packing_buffer_size and packing"
        )

    def state_dict(self) -> dict[str, Any]:
        """The global position in the epoch's plan (the same on every rank, valid for any world size)."""
        consumed = self._consumed_before + self._steps_run * self.world_size
        return {
            "epoch": self._epoch,
            "consumed_batches": consumed,
            "steps": self._steps_before_run + self._steps_run,
            "world_size": self.world_size,
            "plan": self._fingerprint,
            "world_size_independent": True,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("plan") != self._fingerprint:
            raise TokenBudgetError(
                "the checkpoint's token-budget batch plan differs from this run's (other samples, seed, "
                "max_tokens_per_rank, packing_buffer_size, packing or shuffle): a mid-epoch resume would not "
                "continue the same epoch; keep them as they were, or resume at an epoch boundary"
            )
        consumed = int(state.get("consumed_batches", 0))
        epoch = int(state.get("epoch", 0))
        if consumed >= len(self.plan(epoch)):
            return  # the epoch was finished: the next one starts anew
        self._resume_epoch, self._start = epoch, consumed
        self._steps_before = int(state.get("steps", 0))
