"""``checkpoint_format="torch_dcp"``: a directory of DCP shards written by every rank in parallel, ``meta.pt``
(everything else, rank 0's) and ``manifest.json`` last; writable to URLs (:mod:`.remote`) and in the background.

The directory's layout is described in :mod:`.store`; a directory holding Hugging Face safetensors weights
(``hf``, ``torch_dcp+hf``: :mod:`.hf_weights`) is read here too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from lightning_mm.checkpoint import atomic, manifest
from lightning_mm.checkpoint.checkpoint_layout import META_FILE
from lightning_mm.checkpoint.dcp_writers import NoEmptyFiles
from lightning_mm.checkpoint.rank_agreement import is_distributed
from lightning_mm.checkpoint.source import CheckpointSource, open_directory, single_process_quiet
from lightning_mm.checkpoint.writer import StorageFormat, write_file

__all__ = ["DCPFormat"]


class DCPFormat(StorageFormat):
    """A ``torch_dcp`` checkpoint directory."""

    name: ClassVar[str] = "torch_dcp"
    at_urls: ClassVar[bool] = True
    directory = True

    def annotate(self, extra: dict[str, Any]) -> None:
        extra["manifest"] = manifest.MANIFEST_FILE  # a later load insists on it

    def payload(self, checkpoint: dict[str, Any], meta: dict[str, Any], rank0: bool) -> Any:
        return meta  # meta.pt, written by rank 0 once every rank has written its shards

    def write_partial(
        self,
        partial: Path,
        tensors: dict[str, Any],
        payload: Any,
        rank0: bool,
        group: Any,
        also_write: Callable[[Path], list[Path]] | None,
    ) -> dict[str, Any]:
        writer = _Writer(partial, sync_files=True)
        writer.fs = files = manifest.RecordingFileSystem()  # each rank hashes the files it wrote
        with single_process_quiet():
            dcp.save(
                tensors,
                storage_writer=writer,
                planner=DefaultSavePlanner(flatten_state_dict=False),
                process_group=group,
                no_dist=not is_distributed(),
            )
        hashed = manifest.file_entries(files.written)
        if also_write is not None:
            hashed.update(manifest.file_entries(also_write(partial)))
        return hashed

    def seal(self, partial: Path, payload: Any, entries: list[dict[str, Any]]) -> None:
        # The manifest comes last: it binds every file written before it to this checkpoint.
        write_file(payload, partial / META_FILE)
        manifest.write_manifest(partial, entries, [".metadata", META_FILE])
        atomic.fsync_dir(partial)

    def read(self, path: Path, full_check: bool = False, share: tuple[int, int] | None = None) -> CheckpointSource:
        return open_directory(path, full_check, share)

    def recognise(self, path: Path) -> bool:
        return path.is_dir()


class _Writer(NoEmptyFiles, FileSystemWriter):
    pass
