"""MindSpeed MM's ``LengthGroupedSampler`` with ``group_data`` / ``group_frame``: every batch holds samples of one
size (``group_data``: frames x height x width; ``group_frame``: frame count), so that they stack without padding.

The epoch's global batches are planned from the samples' group keys alone, the same on every rank: the samples of
each group (largest group first) are shuffled with ``torch.Generator().manual_seed(seed + epoch)`` (when
``shuffle``), cut into batches of ``batch_size`` (a group's last, short batch is dropped with ``drop_last``, else
filled up with the first samples of the same group, as MindSpeed MM repeats samples of the batch's size), the
batches are shuffled, and rank ``r`` of ``n`` takes batches ``r, r + n, ...``; the batch count is cut (``drop_last``)
or padded by repeating the first batches to a multiple of ``n``, so every rank runs the same number of steps. The
sampler is a ``DistributedSampler``: Lightning keeps it in the loader and calls its ``set_epoch``. The order differs
from MindSpeed MM's (which takes its own unseeded generator on several ranks); which samples share a batch follows
the same rule.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

import torch
from torch.utils.data import Dataset, DistributedSampler

from lightning_mm.errors import ConfigError, DataError

__all__ = ["GroupedDistributedSampler", "plan_grouped_batches"]


def plan_grouped_batches(
    keys: Sequence[Hashable], batch_size: int, world_size: int, seed: int, epoch: int, shuffle: bool, drop_last: bool
) -> list[list[int]]:
    """The epoch's global batches (lists of sample indices, one group key each), a multiple of ``world_size``."""
    if batch_size < 1 or world_size < 1:
        raise ConfigError(f"batch_size and world_size must be >= 1, got {batch_size} and {world_size}")
    generator = torch.Generator().manual_seed(seed + epoch)
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    batches: list[list[int]] = []
    for members in sorted(groups.values(), key=len, reverse=True):  # stable: ties keep first appearance
        if shuffle:
            members = [members[i] for i in torch.randperm(len(members), generator=generator).tolist()]
        for start in range(0, len(members), batch_size):
            batch = members[start : start + batch_size]
            if len(batch) < batch_size:
                if drop_last:
                    continue
                batch = batch + [members[i % len(members)] for i in range(batch_size - len(batch))]
            batches.append(batch)
    if shuffle:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    if drop_last:
        batches = batches[: len(batches) - len(batches) % world_size]
    elif batches and len(batches) % world_size:
        batches = batches + [batches[i % len(batches)] for i in range(world_size - len(batches) % world_size)]
    if not batches:
        raise ConfigError(
            f"no full batch of {batch_size} samples of one size for {world_size} rank(s) "
            f"(groups: {sorted((str(k), len(v)) for k, v in groups.items())})"
        )
    return batches


class GroupedDistributedSampler(DistributedSampler):
    """This rank's indices of :func:`plan_grouped_batches`, batch after batch (the loader's ``batch_size`` must be
    ``batch_size``)."""

    def __init__(
        self,
        dataset: Dataset,
        keys: Sequence[Hashable],
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        if len(keys) != len(dataset):  # type: ignore[arg-type]
            raise DataError(f"{len(keys)} group keys for {len(dataset)} samples")  # type: ignore[arg-type]
        self.keys = list(keys)
        self.batch_size = batch_size

    def _mine(self) -> list[list[int]]:
        batches = plan_grouped_batches(
            self.keys, self.batch_size, self.num_replicas, self.seed, self.epoch, self.shuffle, self.drop_last
        )
        return batches[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter([i for batch in self._mine() for i in batch])

    def __len__(self) -> int:
        return len(self._mine()) * self.batch_size
