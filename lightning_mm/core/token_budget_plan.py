"""Token-budget batches: a deterministic batch plan from the samples' lengths.

:func:`plan_batches` turns the samples' token counts into the epoch's global list of batches, the same on every
rank (it depends on the lengths, the seed, the epoch and the budget, never on the rank or the world size):

1. the sample order: a permutation seeded with ``seed + epoch`` (or ``0..n-1`` unshuffled);
2. that order is cut into buffers of ``buffer_size`` samples; within a buffer the samples are sorted by length,
   longest first, and placed first-fit into batches whose cost stays within ``max_tokens``. The cost of a batch
   is the sum of its lengths when packed (one row, no padding), else ``samples x longest`` (padded rows);
3. the batches of the epoch are shuffled (seeded likewise) so long and short ones alternate over the epoch.

:class:`RankSchedule` deals that list to the data-parallel ranks, ``W`` batches a step: step ``s`` gives rank
``r`` batch ``s * W + r``. Every rank therefore runs ``ceil(batches / W)`` steps (``floor`` with
``drop_last``), computed from the plan alone; the last short step is filled with the epoch's first batches again
(as ``DistributedSampler`` repeats samples). :func:`plan_digest` summarises a plan so that the ranks can check, with
one small collective at the epoch's start, that they planned alike (the loader does). Resuming after ``consumed`` global
batches continues with batch ``consumed`` whatever the new world size, so a resume is exact across a change of
world size as long as the plan is the same (same lengths, seed, budget, buffer and packing); only the repeated
batches of the epoch's last step depend on the world size.

When a batch is built, :func:`check_token_ids` checks each sample's ``input_ids`` (integers in ``[0, vocab)``) and
:func:`check_batch` checks the samples' real lengths against the plan's and the batch against the budget.

Lightning-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_mm.errors import ConfigError

__all__ = [
    "TokenBudgetError",
    "plan_batches",
    "batch_cost",
    "RankSchedule",
    "plan_fingerprint",
    "plan_digest",
    "check_token_ids",
    "check_batch",
]


class TokenBudgetError(ConfigError):
    """A token budget that the samples cannot be batched under."""


def batch_cost(lengths: Sequence[int], packing: bool) -> int:
    """The tokens a batch of samples of these lengths occupies: packed (their sum) or padded (rows x longest)."""
    if not lengths:
        return 0
    return sum(lengths) if packing else len(lengths) * max(lengths)


def plan_batches(
    lengths: Sequence[int],
    max_tokens: int,
    buffer_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    packing: bool = True,
) -> list[list[int]]:
    """The epoch's batches (lists of sample indices) under ``max_tokens``; see the module docstring."""
    if max_tokens < 1:
        raise TokenBudgetError(f"max_tokens_per_rank must be positive, got {max_tokens}")
    if buffer_size < 1:
        raise TokenBudgetError(f"packing_buffer_size must be positive, got {buffer_size}")
    if not lengths:
        raise TokenBudgetError("the training dataset has no sample: token-budget batches need at least one")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        index, length = too_long[0]
        raise TokenBudgetError(
            f"{len(too_long)} sample(s) are longer than max_tokens_per_rank={max_tokens} (sample {index} has "
            f"{length} tokens): raise the budget or cut the samples (cutoff_len / max_length)"
        )
    empty = [i for i, n in enumerate(lengths) if n < 1]
    if empty:
        raise TokenBudgetError(f"sample {empty[0]} has no token")
    generator = torch.Generator().manual_seed(int(seed) + int(epoch))
    order = torch.randperm(len(lengths), generator=generator).tolist() if shuffle else list(range(len(lengths)))
    batches: list[list[int]] = []
    for start in range(0, len(order), buffer_size):
        buffer = sorted(order[start : start + buffer_size], key=lambda i: (-lengths[i], i))
        open_batches: list[tuple[list[int], int, int]] = []  # (indices, sum, longest)
        for index in buffer:
            n = lengths[index]
            for slot, (members, total, longest) in enumerate(open_batches):
                cost = total + n if packing else (len(members) + 1) * max(longest, n)
                if cost <= max_tokens:
                    members.append(index)
                    open_batches[slot] = (members, total + n, max(longest, n))
                    break
            else:
                open_batches.append(([index], n, n))
        batches.extend(members for members, _, _ in open_batches)
    if shuffle:
        permutation = torch.randperm(len(batches), generator=generator).tolist()
        batches = [batches[i] for i in permutation]
    return batches


def plan_fingerprint(
    lengths: Sequence[int], max_tokens: int, buffer_size: int, seed: int, packing: bool, shuffle: bool
) -> str:
    """A short digest of what the plan depends on (checked on resume: another plan would not continue exactly)."""
    import hashlib

    digest = hashlib.sha256(repr((list(lengths), max_tokens, buffer_size, seed, packing, shuffle)).encode())
    return digest.hexdigest()[:16]


def plan_digest(plan: Sequence[Sequence[int]], fingerprint: str = "") -> int:
    """A 63-bit digest of an epoch's batches (and of ``fingerprint``: what they were planned from), to compare
    the ranks' plans with one small collective."""
    import hashlib

    digest = hashlib.sha256(repr((fingerprint, [list(batch) for batch in plan])).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def check_token_ids(input_ids: object, index: int, vocab_size: int | None = None) -> int:
    """The length of sample ``index``'s ``input_ids`` after checking them: a 1-D sequence of integers (not floats or
    booleans) in ``[0, vocab_size)`` (only ``>= 0`` when the vocabulary is unknown); TokenBudgetError naming the
    sample otherwise."""
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TokenBudgetError(f"sample {index}: input_ids are not a sequence of integer token ids ({err})") from None
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise TokenBudgetError(
            f"sample {index}: input_ids must be integer token ids, got {ids.dtype} (a float id would be truncated)"
        )
    if ids.ndim != 1:
        raise TokenBudgetError(f"sample {index}: input_ids must be one sequence (1-D), got shape {tuple(ids.shape)}")
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0:
            raise TokenBudgetError(f"sample {index}: token id {low} is negative")
        if vocab_size is not None and high >= vocab_size:
            raise TokenBudgetError(f"sample {index}: token id {high} is outside the vocabulary of {vocab_size}")
    return int(ids.numel())


def check_batch(
    indices: Sequence[int],
    planned: Sequence[int],
    actual: Sequence[int],
    max_tokens: int,
    packing: bool,
    replaced: Sequence[int] = (),
) -> None:
    """Check one batch as it is built: samples ``indices`` were planned with lengths ``planned`` and have ``actual``.

    A sample longer than planned is a TokenBudgetError naming it (its ``sample_lengths()`` under-reports), unless it
    is a replacement (``replaced``: its record failed to load and another took its place); then the batch must
    still fit ``max_tokens``, else the error names that sample and the batch's cost.
    """
    for index, want, have in zip(indices, planned, actual):
        if have > want and index not in replaced:
            raise TokenBudgetError(
                f"sample {index} has {have} tokens but its length was given as {want} (sample_lengths() must "
                "give each sample's exact token count): the batch plan cannot keep max_tokens_per_rank"
            )
    cost = batch_cost(list(actual), packing)
    if cost > max_tokens:
        grown = [i for i, want, have in zip(indices, planned, actual) if have > want]
        why = f"sample {grown[0]} was replaced by a longer record (its own failed to load): " if grown else ""
        raise TokenBudgetError(
            f"{why}the batch of samples {list(indices)} would hold {cost} tokens, more than max_tokens_per_rank="
            f"{max_tokens}"
        )


@dataclass(frozen=True)
class RankSchedule:
    """Which of the epoch's planned batches a data-parallel rank runs, from global batch ``start`` on."""

    num_batches: int
    world_size: int
    rank: int
    drop_last: bool = False
    start: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise TokenBudgetError(f"rank {self.rank} is outside a data-parallel world of {self.world_size}")

    @property
    def steps(self) -> int:
        """The steps every rank runs in this (rest of the) epoch: the same on all ranks, from the plan alone."""
        remaining = max(self.num_batches - self.start, 0)
        rounding = math.floor if self.drop_last else math.ceil
        return int(rounding(remaining / self.world_size))

    def batch_indices(self) -> list[int]:
        """The global indices of this rank's batches, step by step."""
        if self.num_batches == 0:
            return []
        return [(self.start + step * self.world_size + self.rank) % self.num_batches for step in range(self.steps)]
