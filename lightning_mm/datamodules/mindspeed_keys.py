"""Shared pieces of the MindSpeed MM data config readers: checked sections and the report of bad records."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mm._names import find_unknown_key
from lightning_mm._yaml import short_repr
from lightning_mm.datamodules.data_config import DataConfigError
from lightning_mm.datamodules.records import DataError, DataReport

__all__ = ["check_keys", "strict_or_warn"]



def check_keys(data: Any, known: tuple[str, ...], prefix: str, source: str) -> dict[str, Any]:
    """``data`` as a dict (``None`` is empty); a non-mapping or an unknown key is an error naming it."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise DataConfigError(f"{source}: `{prefix.rstrip('.')}` must be a mapping, got {short_repr(data)}")
    unknown = find_unknown_key(data, list(known), prefix)
    if unknown is not None:
        shown, hint = unknown
        raise DataConfigError(f"{source}: unknown key `{shown}`{hint}")
    return dict(data)


def strict_or_warn(report: DataReport, strict: bool, source: str) -> None:
    """Raise in strict mode when the report has problems; otherwise log its summary."""
    if report.problems and strict:
        raise DataError(f"bad records in strict mode ({source}):\n{report.summary(shown=20)}")
    if report.problems:
        rank_zero_warn(f"data: {report.summary()}")
    else:
        rank_zero_info(f"data: {report.summary()}")
