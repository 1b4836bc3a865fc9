"""Writing a checkpoint (:func:`save`) in one of the storage layouts (:class:`StorageFormat`: a ``torch_dcp``
directory of DCP shards from every rank, :mod:`.dcp_format`; a ``torch`` file from rank 0, :mod:`.torch_format`),
next to its final path and renamed into place when complete; in the background when an executor is given (the
state staged first, into the buffers of a :class:`Staging` kept between saves). :func:`write_file` writes one
synced ``torch.save`` file."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_mm._rank_zero import rank_zero_warn
from lightning_mm.checkpoint import atomic, formats, zip_manifest
from lightning_mm.checkpoint.errors import write_error
from lightning_mm.checkpoint.layout import EXTRA_KEY, pop_loader_states, split_tensors
from lightning_mm.checkpoint.rank_agreement import (
    barrier,
    broadcast_from_rank_zero,
    gather_to_rank_zero,
    raise_on_every_rank,
)
from lightning_mm.checkpoint.safe import check_weights_only
from lightning_mm.checkpoint.state import copy_loops

__all__ = ["FORMATS", "Staging", "StorageFormat", "save", "write_file"]

FORMATS = ("torch_dcp", "torch")
"""The storage layouts of the checkpoint I/O (each a :class:`StorageFormat` registered in :mod:`.formats`)."""


class StorageFormat(formats.CheckpointFormat):
    """A format that :func:`save` writes itself: what is written where (a directory or one file) and how.

    :func:`save` does what every layout shares (the ranks' RNG and dataloader positions gathered, the meta checked
    for ``weights_only``, the partial sibling, the background staging, the commit); the hooks below are the layout.
    """

    directory: bool
    """The checkpoint is a directory (else one file)."""

    def write(
        self,
        checkpoint: dict[str, Any],
        path: Path | str,
        extra: dict[str, Any],
        rng: dict[str, Any] | None,
        *,
        module: Any = None,
        dtype: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        background: Executor | None = None,
        group: Any = None,
        staging: Staging | None = None,
    ) -> Future | None:
        if isinstance(path, str):
            self.refuse_url(path)
            from lightning_mm.checkpoint import remote

            remote.save(checkpoint, path, self.name, extra, rng, storage_options)
            return None
        return save(checkpoint, path, self, extra, rng, background=background, group=group, staging=staging)

    def annotate(self, extra: dict[str, Any]) -> None:
        """Add what this layout records to the checkpoint's ``meta[EXTRA_KEY]``."""

    def payload(self, checkpoint: dict[str, Any], meta: dict[str, Any], rank0: bool) -> Any:
        """What :meth:`write_partial` writes besides the tensors (rank 0's; None on the others)."""
        raise NotImplementedError

    def write_partial(
        self,
        partial: Path,
        tensors: dict[str, Any],
        payload: Any,
        rank0: bool,
        group: Any,
        also_write: Callable[[Path], list[Path]] | None,
    ) -> dict[str, Any]:
        """Write this rank's part into ``partial``; return the manifest entries of the files it wrote."""
        raise NotImplementedError

    def seal(self, partial: Path, payload: Any, entries: list[dict[str, Any]]) -> None:
        """On rank 0, once every rank has written its part (``entries``: each rank's :meth:`write_partial`):
        complete ``partial`` before its commit (e.g. the meta and the manifest)."""


def save(
    checkpoint: dict[str, Any],
    path: Path,
    fmt: str | StorageFormat,
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
    layout = fmt if isinstance(fmt, StorageFormat) else _storage_format(fmt)
    checkpoint = copy_loops(checkpoint)
    ranks = gather_to_rank_zero({"rng": rng, "combined_loader": pop_loader_states(checkpoint)})
    rank0 = ranks is not None
    error = None
    if rank0 and path.exists() and not path.is_symlink() and (path.is_dir() != layout.directory):
        kind = "directory" if path.is_dir() else "file"
        error = f"cannot write a {layout.name} checkpoint to {path}: a {kind} of the other format is there"
    meta, tensors = split_tensors(checkpoint)
    meta[EXTRA_KEY] = {**extra, "format": layout.name, "ranks": ranks}
    layout.annotate(meta[EXTRA_KEY])
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
    payload = layout.payload(checkpoint, meta, rank0)
    if background is None:
        _write(path, partial, layout, tensors, payload, rank0, group, also_write)
        return None
    if also_write is not None:  # it reads the live model: not safe beside training
        raise ValueError("a background save cannot also write Hugging Face weights (checkpoint_format with 'hf')")
    if staging is None:
        with Staging() as once:
            tensors = once.stage(tensors)
    else:
        tensors = staging.stage(tensors)
    payload = _serialised(payload) if rank0 else None
    return background.submit(_write, path, partial, layout, tensors, payload, rank0, group)


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


def _storage_format(name: str) -> StorageFormat:
    """The storage layout registered as ``name``."""
    layouts = {n: f for n in formats.format_names() if isinstance(f := formats.checkpoint_format(n), StorageFormat)}
    if name not in layouts:
        raise ValueError(f"checkpoint_format must be one of {tuple(layouts)}, got {name!r}")
    return layouts[name]


def _write(
    path: Path,
    partial: Path,
    layout: StorageFormat,
    tensors: dict[str, Any],
    payload: Any,
    rank0: bool,
    group: Any,
    also_write: Callable[[Path], list[Path]] | None = None,
) -> None:
    """The write of :func:`save`: this rank's part, the layout's seal on rank 0, the commit."""
    failure, original, hashed = None, None, {}
    try:
        hashed = layout.write_partial(partial, tensors, payload, rank0, group, also_write)
    except (Exception, CheckpointException) as error:
        failure, original = write_error(error, path), error
    results = gather_to_rank_zero((failure, hashed), group)
    if rank0:
        assert results is not None  # rank 0 holds every rank's result
        failure = next((f for f, _ in results if f is not None), None)
        if failure is None:
            try:
                layout.seal(partial, payload, [h for _, h in results])
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
