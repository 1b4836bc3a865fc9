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
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from lightning_mm._utils.distributed import rank_zero_warn
from lightning_mm.checkpoint import atomic, formats, zip_manifest
from lightning_mm.checkpoint.checkpoint_errors import write_error
from lightning_mm.checkpoint.checkpoint_layout import EXTRA_KEY, pop_loader_states, split_tensors
from lightning_mm.checkpoint.rank_agreement import (
    barrier,
    broadcast_from_rank_zero,
    gather_to_rank_zero,
    is_distributed,
    raise_first_on_every_rank,
    raise_on_every_rank,
)
from lightning_mm.checkpoint.safe import check_weights_only
from lightning_mm.checkpoint.state import copy_loops
from lightning_mm.errors import ConfigError

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

    With ``background`` (an executor running one task at a time), the refusals are agreed first (one collective on
    ``group``: the same errors as without), then the state is staged (copied: :class:`Staging`, into pinned memory
    where the tensors live on an accelerator; the rest serialised) and the gather of the ranks' entries, the
    partial, the write, the manifest and the commit run there, their collectives on ``group`` (a process group of
    their own, so that they never interleave with training's; the caller waited for the previous write); the
    returned future completes once the checkpoint is in place (its ``result()`` raises what failed). Without,
    everything happens before this returns (None). ``staging`` (with ``background``) holds the staging buffers
    between saves, so that a save refills the previous save's buffers instead of allocating new ones; its previous
    write must be complete (the caller waits for it first). Without, each save stages into new buffers.
    """
    layout = fmt if isinstance(fmt, StorageFormat) else _storage_format(fmt)
    checkpoint = copy_loops(checkpoint)
    own = {"rng": rng, "combined_loader": pop_loader_states(checkpoint)}
    meta, tensors = split_tensors(checkpoint)
    meta[EXTRA_KEY] = {**extra, "format": layout.name, "ranks": None}
    layout.annotate(meta[EXTRA_KEY])
    if background is None:
        ranks = gather_to_rank_zero(own)
        rank0 = ranks is not None
        meta[EXTRA_KEY]["ranks"] = ranks
        raise_on_every_rank(_refusal(path, layout, meta) if rank0 else None)
        partial, failed = _prepare(path, rank0)
        if failed is not None:
            raise failed
        payload = layout.payload(checkpoint, meta, rank0)
        _write(path, partial, layout, tensors, payload, rank0, group, also_write)
        return None
    if also_write is not None:  # it reads the live model: not safe beside training
        raise ConfigError("a background save cannot also write Hugging Face weights (checkpoint_format with 'hf')")
    # The loop waits for what must see the live state (the refusals, agreed in one collective; the copies; the
    # meta serialised) and nothing else: the gather of the ranks' entries, the partial and the rest run in the
    # background, their collectives on ``group``.
    rank = dist.get_rank() if is_distributed() else 0
    error = _refusal(path, layout, meta) if rank == 0 else None
    if rank == 0 and error is None:
        try:  # now: what links to the checkpoint before it is complete (ModelCheckpoint's `last`) needs its folder
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            error = f"cannot write a checkpoint into {path.parent}: {err.strerror or err}"
    raise_first_on_every_rank(error or _refusal_of_own(own, rank), group)
    if staging is None:
        with Staging() as once:
            tensors = once.stage(tensors)
    else:
        tensors = staging.stage(tensors)
    payload = _serialised(layout.payload(checkpoint, meta, True)) if rank == 0 else None
    return background.submit(_write_in_background, path, layout, own, tensors, payload, rank == 0, group)


def _refusal(path: Path, layout: StorageFormat, meta: dict[str, Any]) -> str | None:
    """Rank 0's reason not to write ``meta`` at ``path`` (None: none): a checkpoint of the other layout is there,
    or the meta would not load ``weights_only``."""
    if path.exists() and not path.is_symlink() and (path.is_dir() != layout.directory):
        kind = "directory" if path.is_dir() else "file"
        return f"cannot write a {layout.name} checkpoint to {path}: a {kind} of the other format is there"
    try:
        check_weights_only(meta)
    except TypeError as err:
        return str(err)
    return None


def _refusal_of_own(own: dict[str, Any], rank: int) -> str | None:
    """A rank's own entry of ``meta[EXTRA_KEY]["ranks"]`` (its dataloader position) checked as rank 0 checks the
    gathered ones (the same message), before it is gathered."""
    if not own.get("combined_loader"):
        return None  # the RNG states are torch's and Python's own: always loadable
    try:
        check_weights_only({EXTRA_KEY: {"ranks": [None] * rank + [own]}})
    except TypeError as err:
        return str(err)
    return None


def _prepare(path: Path, rank0: bool, group: Any = None) -> tuple[Path, Exception | None]:
    """Every rank: the partial path of rank 0, once rank 0 has removed abandoned partials and made the parent; and
    what failed there on rank 0 (to be shared by the write, so that no rank waits alone in a collective)."""
    partial = Path(broadcast_from_rank_zero(str(atomic.partial_path(path)), group))
    failed = None
    if rank0:
        try:
            for stale in atomic.abandoned_partials(path.parent):  # only partials whose writer is gone, or ours
                atomic.remove(stale)
            others = atomic.live_writers(path)
            if others:
                rank_zero_warn(
                    f"another run is saving {path.name} here ({'; '.join(others)}): the checkpoint "
                    f"committed last replaces the other in {path.parent}"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
        except Exception as error:
            failed = error
    barrier(group)
    return partial, failed


def _write_in_background(
    path: Path,
    layout: StorageFormat,
    own: dict[str, Any],
    tensors: dict[str, Any],
    payload: bytes | None,
    rank0: bool,
    group: Any,
) -> None:
    """A background save after its staging: the ranks' entries gathered into the meta, the partial, the write."""
    ranks = gather_to_rank_zero(own, group)
    partial, failed = _prepare(path, rank0, group)
    written: Any = None
    if rank0 and failed is None:
        assert payload is not None and ranks is not None
        try:
            written = torch.load(io.BytesIO(payload), weights_only=True)  # checked loadable before it was staged
            written[EXTRA_KEY]["ranks"] = ranks
        except Exception as error:
            failed = error
    _write(path, partial, layout, tensors, written, rank0, group, failed=failed)


class Staging:
    """The CPU copies a background save writes from, kept from one save to the next.

    :meth:`stage` copies each tensor (a DTensor: its local shard) into a buffer of its own, allocated at the first
    save (by DCP's ``DefaultStager``: pinned where the tensors live on an accelerator) and refilled by the saves
    after it with one ``copy_`` per tensor (non-blocking on an accelerator, synchronised before it returns), so that
    a save after the first allocates nothing and walks no object tree: the loop waits for the copies only. A staged
    DTensor (the source's mesh, placements and global shape over a CPU shard) is made once, with its buffer. A
    buffer is kept per checkpoint key while the key's tensor keeps its layout (shape, dtype, sharding); a key gone
    or changed frees or replaces it. The buffers are overwritten by the next :meth:`stage`: the write of the
    previous one must be complete by then. :meth:`close` frees them.
    """

    def __init__(self) -> None:
        self._slots: dict[str, tuple[Any, torch.Tensor, Any]] = {}
        """Checkpoint key -> (layout of the source, CPU buffer, the staged value written: buffer or DTensor)."""

    def stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        accelerated = any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors.values())
        layouts, sources, fresh = {}, {}, {}
        for key, value in tensors.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            layouts[key], sources[key] = _layout(value, local, accelerated), local
            slot = self._slots.get(key)
            if slot is None or slot[0] != layouts[key]:
                fresh[key] = value
        made = _new_buffers(fresh, accelerated) if fresh else {}  # copied by DCP's stager as it allocates
        slots = {}
        with torch.no_grad():
            for key, source in sources.items():
                if key in made:
                    slots[key] = (layouts[key], *made[key])
                else:
                    slots[key] = self._slots[key]
                    slots[key][1].copy_(source, non_blocking=accelerated)
        self._slots = slots  # keys no longer saved free their buffers
        if accelerated:
            torch.accelerator.synchronize()  # the non-blocking copies are complete before training goes on
        return {key: slot[2] for key, slot in slots.items()}

    def close(self) -> None:
        self._slots = {}

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_buffers(tensors: dict[str, Any], accelerated: bool) -> dict[str, tuple[torch.Tensor, Any]]:
    """CPU copies of ``tensors`` made by DCP's stager (pinned where the tensors live on an accelerator; a DTensor
    stays a DTensor of the same mesh and placements over a CPU shard), each with the local tensor that holds it."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(accelerated, False, False, accelerated))
    try:
        written = cast("dict[str, Any]", stager.stage(tensors))  # synchronous staging: the dict itself
    finally:
        stager.close()
    with torch.no_grad():
        return {k: (v.to_local() if isinstance(v, DTensor) else v, v) for k, v in written.items()}


def _layout(value: torch.Tensor, local: torch.Tensor, pinned: bool) -> tuple[Any, ...]:
    """What a staging buffer (and its DTensor) depends on: the same layout refills the same buffer."""
    if isinstance(value, DTensor):
        return (local.shape, local.dtype, pinned, value.shape, value.placements, id(value.device_mesh))
    return (local.shape, local.dtype, pinned)


def _serialised(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _storage_format(name: str) -> StorageFormat:
    """The storage layout registered as ``name``."""
    layouts = {n: f for n in formats.format_names() if isinstance(f := formats.checkpoint_format(n), StorageFormat)}
    if name not in layouts:
        raise ConfigError(f"checkpoint_format must be one of {tuple(layouts)}, got {name!r}")
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
    failed: Exception | None = None,
) -> None:
    """The write of :func:`save`: this rank's part, the layout's seal on rank 0, the commit. ``failed``: what
    failed before on this rank (every rank raises it, nothing is written)."""
    failure, original, hashed = None, None, {}
    try:
        if failed is not None:
            raise failed
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
