"""A DataLoader that Lightning can checkpoint mid-epoch (its stateful-loader interface)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["ResumableDataLoader"]


class ResumableDataLoader(DataLoader):
    """Remembers how many batches of the current epoch it has yielded; Lightning saves that in the checkpoint.

    On resume the first pass skips the batches the checkpointed run already consumed, so training continues with
    the next unseen batch (the order is the same: samplers are seeded and Lightning sets their epoch). Skipped
    batches are read and dropped, which costs loading time but needs no knowledge of the sampler.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._skip = 0

    # A generator rather than DataLoader's _BaseDataLoaderIter: its callers (Lightning, a for loop) only iterate.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._skip = self._skip, 0
        iterator = super().__iter__()
        for _ in range(skip):
            next(iterator)
        self._yielded = skip
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        yielded = int(state.get("yielded", 0))
        self._skip = yielded if yielded < len(self) else 0  # a finished epoch starts anew
