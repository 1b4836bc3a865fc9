"""``checkpoint_format="torch"``: one consolidated file in Lightning's layout (full tensors gathered on rank 0),
written by rank 0, its manifest a record inside its zip archive (:mod:`.zip_manifest`); local paths only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from lightning_mm.checkpoint.checkpoint_layout import EXTRA_KEY
from lightning_mm.checkpoint.source import CheckpointSource, open_file
from lightning_mm.checkpoint.writer import StorageFormat, write_file

__all__ = ["TorchFormat"]


class TorchFormat(StorageFormat):
    """A ``torch`` checkpoint file."""

    name: ClassVar[str] = "torch"
    full: ClassVar[bool] = True
    directory = False

    def payload(self, checkpoint: dict[str, Any], meta: dict[str, Any], rank0: bool) -> Any:
        if not rank0:
            return None
        payload = dict(checkpoint)
        payload[EXTRA_KEY] = meta[EXTRA_KEY]
        return payload

    def write_partial(
        self,
        partial: Path,
        tensors: dict[str, Any],
        payload: Any,
        rank0: bool,
        group: Any,
        also_write: Callable[[Path], list[Path]] | None,
    ) -> dict[str, Any]:
        if rank0:
            write_file(payload, partial, with_manifest=True)
        return {}

    def read(self, path: Path, full_check: bool = False, share: tuple[int, int] | None = None) -> CheckpointSource:
        return open_file(path, share)

    def recognise(self, path: Path) -> bool:
        return not path.is_dir()  # every other path is read as a file (and checked as one)
