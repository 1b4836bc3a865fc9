"""What every record dataset does when a record fails as it is read: the next good record takes its place.

Records are checked up front; reading one in ``__getitem__`` can still fail (a pixel stream that does not decode,
text the processor rejects, any exception while preprocessing it). Then the next good record (in file order,
wrapping around) is returned in its place: the dataset keeps its length, so every data-parallel rank yields the same
number of batches and no collective waits on a missing one. Token-budget batches plan with the samples' lengths; the
loader then calls :meth:`ReplacingDataset.limit_replacements` so that a replacement is taken among the records no
longer than the one it replaces (by those lengths; any good record only when none is), and the batch keeps its budget.
The failed record is counted once in the split's
:class:`~lightning_mm.data.record_files.DataReport` with its ``file:line``, warned about, and not read again in this
process; :data:`MAX_FAILURES_IN_A_ROW` failures for one index are a :class:`DataError` (something systematic, not one
bad file), and so is the first failure in strict mode. With ``num_workers > 0`` this happens in the worker
processes: each warns, but the main process's report does not see their counts.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset

from lightning_mm.data.record_files import DataError, DataReport

__all__ = ["ReplacingDataset", "MAX_FAILURES_IN_A_ROW"]

MAX_FAILURES_IN_A_ROW = 32
"""Records in a row that may fail for one index before the dataset gives up instead of trying every record."""


class ReplacingDataset(Dataset):
    """A dataset of checked ``records`` whose :meth:`sample` may fail for one record (see the module docstring).

    Subclasses give :meth:`sample`; :meth:`problem` says what failed (default: ``file:line: cannot process the
    record: <error>``), and the class attributes word the errors.
    """

    failed_in_a_row = "records in a row failed to process"
    nothing_readable = "no record could be processed"
    broken = "the data or the processor is broken"

    def __init__(self, records: list[Any], report: DataReport | None = None, strict: bool = False) -> None:
        self.records = records
        self.report = report if report is not None else DataReport("data")
        self.strict = strict
        self.bad: set[int] = set()  # indices of records that failed here
        self.replacement_lengths: list[int] | None = None  # see limit_replacements

    def __len__(self) -> int:
        return len(self.records)

    def sample(self, record: Any) -> dict[str, Any]:
        """The sample of one record (raises when the record cannot be read)."""
        raise NotImplementedError

    def where(self, record: Any) -> str:
        return f"{record.file.name}:{record.line}"

    def problem(self, record: Any, err: Exception) -> str:
        return f"{self.where(record)}: cannot process the record: {str(err)[:200]}"

    def _skip(self, index: int, err: Exception) -> None:
        problem = self.problem(self.records[index], err)
        if self.strict:
            raise DataError(f"bad record in strict mode: {problem}") from err
        self.bad.add(index)
        self.report.problems.append(f"{problem} (at load time; the next good record is used in its place)")
        warnings.warn(f"data: skipped {problem}; the next good record is used in its place", stacklevel=3)

    def limit_replacements(self, lengths: list[int]) -> None:
        """Replace a failed record by the next good one no longer than it (by ``lengths``, one per record), and
        only when there is none by any good one: token-budget batches keep their budget."""
        if len(lengths) != len(self.records):
            raise ValueError(f"{len(lengths)} lengths for {len(self.records)} records")
        self.replacement_lengths = list(lengths)

    def _candidates(self, index: int) -> Iterator[int]:
        """The record of ``index``, then its possible replacements in file order (wrapping around)."""
        n = len(self.records)
        start = index % n
        yield start
        lengths = self.replacement_lengths
        if lengths is None:
            yield from ((start + step) % n for step in range(1, n))
            return
        cap = lengths[start]
        yield from ((start + step) % n for step in range(1, n) if lengths[(start + step) % n] <= cap)
        yield from ((start + step) % n for step in range(1, n) if lengths[(start + step) % n] > cap)

    def __getitem__(self, index: int) -> dict[str, Any]:
        failures = 0
        for current in self._candidates(index):
            if current in self.bad:
                continue
            try:
                return self.sample(self.records[current])
            except Exception as err:  # any failure of one record's preprocessing is that record's problem
                self._skip(current, err)
                failures += 1
                if failures >= MAX_FAILURES_IN_A_ROW:
                    raise DataError(
                        f"{self.report.split}: {failures} {self.failed_in_a_row} (the last at "
                        f"{self.where(self.records[current])}); {self.broken}"
                    ) from err
        raise DataError(f"{self.report.split}: {self.nothing_readable} ({len(self.bad)} failed)")
