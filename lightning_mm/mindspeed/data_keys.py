"""Shared pieces of the MindSpeed MM data config readers: checked sections and the report of bad records."""

from __future__ import annotations

from typing import Any

from lightning_mm._utils.distributed import rank_zero_info, rank_zero_warn
from lightning_mm.data.data_config import check_mapping_keys
from lightning_mm.data.record_files import DataError, DataReport

__all__ = ["check_keys", "strict_or_warn"]


def check_keys(data: Any, known: tuple[str, ...], prefix: str, source: str) -> dict[str, Any]:
    """``data`` as a dict, ``None`` (an empty YAML section) as ``{}``; else as :func:`check_mapping_keys`."""
    return {} if data is None else check_mapping_keys(data, known, prefix, source)


def strict_or_warn(report: DataReport, strict: bool, source: str) -> None:
    """Raise in strict mode when the report has problems; otherwise log its summary."""
    if report.problems and strict:
        raise DataError(f"bad records in strict mode ({source}):\n{report.summary(shown=20)}")
    if report.problems:
        rank_zero_warn(f"data: {report.summary()}")
    else:
        rank_zero_info(f"data: {report.summary()}")
