"""The exceptions of checkpoint I/O: short messages that name the file, instead of torch's internals.

* :class:`CheckpointError`: the base (a :class:`~lightning_mm.errors.LightningMMError`); every message starts with
  the file (or directory) concerned.
* :class:`CheckpointIntegrityError`: a checkpoint whose files are missing, truncated, altered, foreign (from
  another checkpoint) or outside its directory.
* :class:`CheckpointMismatchError`: a readable checkpoint that does not fit what loads it (missing, unexpected or
  misshapen weights, another number of optimizers, a newer format).
* :class:`CheckpointWriteError`: a save that failed on the disk (``errno`` and ``filename`` as in ``OSError``).
* :class:`CheckpointNotFoundError`: the checkpoint asked for is not there (e.g. ``ckpt_path="last"`` whose ``last``
  link points at a deleted checkpoint), a ``FileNotFoundError``.

:func:`write_error` turns what a failed write raised (an ``OSError``, DCP's ``CheckpointException`` collecting the
failures of every rank, or torch's ``[enforce fail at inline_container.cc] unexpected pos`` when a full disk cut a
``torch.save`` short) into a :class:`CheckpointWriteError`.
"""

from __future__ import annotations

import errno
import os
from pathlib import PurePath

from lightning_mm.errors import LightningMMError

__all__ = [
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CheckpointNotFoundError",
    "write_error",
]

_FREE_SPACE_FLOOR = 1 << 20  # a write failure with less than this free is taken for a full disk


class CheckpointError(LightningMMError):
    """A checkpoint that cannot be read or written; the message names the file."""


class CheckpointIntegrityError(CheckpointError, ValueError):
    """A checkpoint file is missing, truncated, altered, from another checkpoint, or outside the checkpoint."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A readable checkpoint that does not fit the model, module or program that loads it (the message lists what)."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed on the disk (e.g. ``errno.ENOSPC``); ``filename`` names the path."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}" if self.filename is not None else super().__str__()


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint asked for does not exist (the message names the path, or the link and its target)."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


def _causes(error: BaseException) -> list[BaseException]:
    """``error``, its causes and contexts, and the per-rank failures of a DCP ``CheckpointException``."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            for failure in failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return [s for s in seen if isinstance(s, BaseException)]


def _disk_full(path: PurePath) -> bool:
    """True when the file system holding ``path`` (or its nearest existing parent) has (almost) no space left."""
    for candidate in (path, *path.parents):
        try:
            stat = os.statvfs(candidate)
        except (OSError, AttributeError):
            continue
        return stat.f_bavail * stat.f_frsize < _FREE_SPACE_FLOOR
    return False


def write_error(error: BaseException, path: PurePath) -> CheckpointWriteError:
    """What failed while writing the checkpoint at ``path`` (its final path), as a :class:`CheckpointWriteError`."""
    causes = _causes(error)
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno is not None:
            return CheckpointWriteError(cause.errno, os.strerror(cause.errno), str(path))
    text = " ".join(str(c) for c in causes)
    if "No space left" in text or (("unexpected pos" in text or "inline_container" in text) and _disk_full(path)):
        return CheckpointWriteError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return CheckpointWriteError(
        errno.EIO,
        f"writing the checkpoint failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
        str(path),
    )
