"""Writing a checkpoint (:func:`save`): a ``torch_dcp`` directory (DCP shards from every rank, ``meta.pt`` and
``manifest.json`` from rank 0) or a ``torch`` file (rank 0), next to its final path and renamed into place when
complete; in the background when an executor is given (the state staged first, into the buffers of a
:class:`Staging` kept between saves). :func:`write_file` writes one synced ``torch.save`` file."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from lightning_mm._rank_zero import rank_zero_warn
from lightning_mm.checkpoint import atomic, manifest, zip_manifest
from lightning_mm.checkpoint.errors import write_error
from lightning_mm.checkpoint.layout import EXTRA_KEY, META_FILE, pop_loader_states, split_tensors
from lightning_mm.checkpoint.rank_agreement import (
    barrier,
    broadcast_from_rank_zero,
    gather_to_rank_zero,
    is_distributed,
    raise_on_every_rank,
)
from lightning_mm.checkpoint.safe import check_weights_only
from lightning_mm.checkpoint.source import single_process_quiet
from lightning_mm.checkpoint.state import copy_loops
from lightning_mm.errors import ConfigError

__all__ = ["FORMATS", "Staging", "save", "write_file"]

FORMATS = ("torch_dcp", "torch")


def save(
    checkpoint: dict[str, Any],
    path: Path,
    fmt: str,
    extra: dict[str, Any],
    rng: dict[str, Any] | None,
    also_write: Callable[[Path], list[Path]] | None = None,
    background: Executor | None = None,
    group: Any = None,
    staging: Staging | None = None,
) -> Future | None:
    """Write ``checkpoint`` (Lightning's dict) to ``path`` atomically; every rank calls this.

    ``extra`` (rank 0's) goes to ``meta[EXTRA_KEY]``; each rank's ``rng`` state and dataloader position are
    gathered into ``meta[EXTRA_KEY]["ranks"]``. ``also_write`` (``torch_dcp``; every rank calls it with the
    partial directory after the DCP files are written) writes more files into the checkpoint, e.g. Hugging Face
    weights (:mod:`.hf_weights`); the files it returns are listed in the manifest.

    With ``background`` (an executor running one task at a time), the state is staged (copied: DCP's stager, into
    pinned memory where the tensors live on an accelerator; the rest serialised) and the write, the manifest and
    the commit run there, their collectives on ``group`` (a process group of their own, so that they never
    interleave with training's); the returned future completes once the checkpoint is in place (its ``result()``
    raises what failed). Without, everything happens before this returns (None). ``staging`` (with ``background``)
    holds the staging buffers between saves, so that a save refills the previous save's buffers instead of
    allocating new ones; its previous write must be complete (the caller waits for it first). Without, each save
    stages into new buffers.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"checkpoint_format must be one of {FORMATS}, got {fmt!r}")
    checkpoint = copy_loops(checkpoint)
    ranks = gather_to_rank_zero({"rng": rng, "combined_loader": pop_loader_states(checkpoint)})
    rank0 = ranks is not None
    error = None
    if rank0 and path.exists() and not path.is_symlink() and (path.is_dir() != (fmt == "torch_dcp")):
        kind = "directory" if path.is_dir() else "file"
        error = f"cannot write a {fmt} checkpoint to {path}: a {kind} of the other format is there"
    meta, tensors = split_tensors(checkpoint)
    meta[EXTRA_KEY] = {**extra, "format": fmt, "ranks": ranks}
    if fmt == "torch_dcp":
        meta[EXTRA_KEY]["manifest"] = manifest.MANIFEST_FILE  # a later load insists on it
    if rank0 and error is None:
        try:
            check_weights_only(meta)
        except TypeError as err:
            error = str(err)
    raise_on_every_rank(error)
    partial = Path(broadcast_from_rank_zero(str(atomic.partial_path(path))))
    if rank0:
        for stale in atomic.abandoned_partials(path.parent):  # only partials whose writer is gone, or ours
            atomic.remove(stale)
        others = atomic.live_writers(path)
        if others:
            rank_zero_warn(
                f"another run is saving {path.name} here ({'; '.join(others)}): the checkpoint "
                f"committed last replaces the other in {path.parent}"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    if fmt == "torch_dcp":
        payload: Any = meta
    else:
        payload = None
        if rank0:
            payload = dict(checkpoint)
            payload[EXTRA_KEY] = meta[EXTRA_KEY]
    if background is None:
        _write(path, partial, fmt, tensors, payload, rank0, group, also_write)
        return None
    if also_write is not None:  # it reads the live model: not safe beside training
        raise ConfigError("a background save cannot also write Hugging Face weights (checkpoint_format with 'hf')")
    if staging is None:
        with Staging() as once:
            tensors = once.stage(tensors)
    else:
        tensors = staging.stage(tensors)
    payload = _serialised(payload) if rank0 else None
    return background.submit(_write, path, partial, fmt, tensors, payload, rank0, group)


class Staging:
    """The CPU copies a background save writes from, kept from one save to the next.

    :meth:`stage` copies the tensors (DTensors: their local shards) with DCP's ``DefaultStager`` (synchronous;
    pinned memory and non-blocking copies where the tensors live on an accelerator). The stager keeps one CPU
    storage per source storage (weakly keyed: it goes with the parameter or optimiser state it copies) and refills
    it at the next :meth:`stage`, so that a save after the first allocates nothing: the loop waits for the copy
    only, not for fresh memory (and its page faults). The buffers are overwritten by the next :meth:`stage`: the
    write of the previous one must be complete by then. :meth:`close` frees them.
    """

    def __init__(self) -> None:
        self._stager: Any = None
        self._accelerated: bool | None = None

    def stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        accelerated = any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors.values())
        if self._stager is None or accelerated != self._accelerated:
            self.close()
            self._accelerated = accelerated
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=accelerated,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=accelerated,
                )
            )
        # Synchronous staging (use_async_staging=False) returns the staged dict itself, never a Future.
        return cast("dict[str, Any]", self._stager.stage(tensors))

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serialised(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write(
    path: Path,
    partial: Path,
    fmt: str,
    tensors: dict[str, Any],
    payload: Any,
    rank0: bool,
    group: Any,
    also_write: Callable[[Path], list[Path]] | None = None,
) -> None:
    """The write of :func:`save`: DCP shards (every rank) or the file (rank 0), the manifest, the commit."""
    failure, original, hashed = None, None, {}
    try:
        if fmt == "torch_dcp":
            writer = FileSystemWriter(partial, sync_files=True)
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
        elif rank0:
            write_file(payload, partial, with_manifest=True)
    except (Exception, CheckpointException) as error:
        failure, original = write_error(error, path), error
    results = gather_to_rank_zero((failure, hashed), group)
    if rank0:
        assert results is not None  # rank 0 holds every rank's result
        failure = next((f for f, _ in results if f is not None), None)
        if failure is None and fmt == "torch_dcp":
            try:  # the manifest comes last: it binds every file written before it to this checkpoint
                write_file(payload, partial / META_FILE)
                manifest.write_manifest(partial, [h for _, h in results], [".metadata", META_FILE])
                atomic.fsync_dir(partial)
            except Exception as error:
                failure, original = write_error(error, path), error
        if failure is not None:
            with contextlib.suppress(OSError):
                atomic.remove(partial)  # free the space now; the next save removes what is left
    failure = broadcast_from_rank_zero(failure, group)
    if failure is not None:
        raise failure from original
    if rank0:
        atomic.commit(partial, path)
    barrier(group)


def write_file(obj: Any, path: Path, with_manifest: bool = False) -> None:
    """``torch.save`` to ``path`` (``obj`` already serialised when bytes), synced; ``with_manifest`` (a ``torch``
    format checkpoint) adds its manifest."""
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if with_manifest:
        zip_manifest.append(path)
