"""Making a checkpoint visible only once it is complete, and removing one without leaving half of it.

A checkpoint is written to a hidden sibling ``.<name>.partial-<token>`` and renamed into place when every rank
has finished. A hidden name never matches ModelCheckpoint's ``last``/``*.ckpt`` patterns, so ``ckpt_path="last"``
cannot pick up an interrupted save. Replacing an existing checkpoint directory (``save_last=True`` overwrites
``last.ckpt``) swaps the two directories in one ``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere the old one is
moved aside first, so that at every moment either the old or the new checkpoint is complete on disk.

The token of a partial names its writer: ``<host>-<pid>-<start>-<random>`` (a hash of the host name, boot and
process-id namespace, the writing process and its start time); so does the token of a ``.<name>.removing-<token>``
entry (a checkpoint being deleted, or the old one a commit moves aside). :func:`abandoned_partials` finds the
entries, of any checkpoint name in a directory, same-name ones included, whose writer is this process (its saves
run one at a time, so none of them is still being written) or provably gone: a process of this host (and
process-id namespace) that no longer runs, or whose process id now names a process with another start time. An
entry written from another host or container, by a process that still runs, or named without an owner (an older
version's), is never one of them: two live runs saving into one directory never delete each other's files.

Two runs committing the same checkpoint name at the same time both succeed: each commit is a rename or an atomic
exchange, retried when the other run's commit changed the final path in between; the checkpoint committed last is
the one left.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import shutil
import socket
import sys
import uuid
from pathlib import Path, PurePath
from typing import TypeVar

from lightning_mm.checkpoint.checkpoint_errors import CheckpointWriteError

__all__ = [
    "partial_path",
    "stale_partials",
    "abandoned_partials",
    "is_abandoned",
    "live_writers",
    "commit",
    "remove",
    "fsync_dir",
]

_PARTIAL = ".partial-"
_REMOVING = ".removing-"
_OWNED = re.compile(
    r"^\..+\.(?:partial|removing)-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-"
    r"[0-9a-f]{8}$"
)
_COMMIT_TRIES = 8  # each retry follows a change of the final path by another run's commit


@functools.lru_cache(maxsize=1)
def _host() -> str:
    """This host, boot and process-id namespace: where a process id names the same process as here."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}/{boot}/{namespace}".encode()).hexdigest()[:8]


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), None if it does not run; 0 if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def _owner() -> str:
    pid = os.getpid()
    return f"{_host()}-{pid}-{_start_time(pid) or 0}"


_P = TypeVar("_P", bound=PurePath)  # a local path, or a remote store's (PurePosixPath)


def partial_path(final: _P, token: str | None = None) -> _P:
    """The hidden sibling a checkpoint is written to before :func:`commit` (its token names this process)."""
    return final.parent / f".{final.name}{_PARTIAL}{token or _token()}"


def _token() -> str:
    return f"{_owner()}-{uuid.uuid4().hex[:8]}"


def _aside(path: Path) -> Path:
    """The name under which ``path`` is moved out of sight before it is deleted (owned by this process)."""
    return path.parent / f".{path.name}{_REMOVING}{_token()}"


def stale_partials(final: Path) -> list[Path]:
    """Every partial (and removal) of ``final`` present, whoever owns it: what an interrupted save may have left.
    Saves remove only the :func:`abandoned_partials` among them."""
    if not final.parent.is_dir():
        return []
    prefixes = (f".{final.name}{_PARTIAL}", f".{final.name}{_REMOVING}")
    return sorted(p for p in final.parent.iterdir() if p.name.startswith(prefixes))


def _abandoned(name: str) -> bool:
    match = _OWNED.match(name)
    if match is None or match["host"] != _host():
        return False  # not named by this version, or written from another host: its writer may still run
    pid, start = int(match["pid"]), int(match["start"])
    if pid == os.getpid():
        return True  # ours: this process's saves run one after the other
    now = _start_time(pid)
    return now is None or (now != 0 and start != 0 and now != start)  # gone, or the id now names another process


def is_abandoned(name: str) -> bool:
    """Whether the partial or removal entry ``name`` (a base name, on any store) was left by this process or by a
    process that is provably gone (the rule :func:`abandoned_partials` applies; object stores use it too)."""
    return (_PARTIAL in name or _REMOVING in name) and _abandoned(name)


def abandoned_partials(directory: Path) -> list[Path]:
    """Partials and removals in ``directory`` (any checkpoint name) left by this process or by a process that is
    provably gone (see the module docstring)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if (_PARTIAL in p.name or _REMOVING in p.name) and _abandoned(p.name))


def live_writers(final: Path) -> list[str]:
    """Who else is saving ``final`` now: ``"host <name>, pid <pid>"`` for each partial of it whose writer, another
    process of this host, still runs (writers on other hosts cannot be told from leftovers, and are not listed)."""
    found = []
    for path in stale_partials(final):
        match = _OWNED.match(path.name)
        if path.name.startswith(f".{final.name}{_PARTIAL}") and match is not None and match["host"] == _host():
            pid = int(match["pid"])
            if pid != os.getpid() and not _abandoned(path.name):
                found.append(f"host {socket.gethostname()}, pid {pid}")
    return sorted(set(found))


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Raced(Exception):
    """Another run's commit changed the final path between two steps of this one: look again."""


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    if err == errno.ENOENT:
        raise _Raced
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def _delete(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)


_TAKEN = (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR)  # the final path was (re)created meanwhile


def _rename(source: Path, target: Path) -> None:
    try:
        os.rename(source, target)
    except OSError as err:
        if err.errno in _TAKEN:
            raise _Raced from None
        raise


def _commit_once(partial: Path, final: Path) -> None:
    if final.is_symlink():  # e.g. a `last.ckpt` link of save_last="link": the link is replaced, not its target
        final.unlink(missing_ok=True)
    if not final.exists():
        _rename(partial, final)
    elif partial.is_file() and final.is_file() and not final.is_symlink():
        try:
            os.replace(partial, final)
        except OSError as err:
            if err.errno in _TAKEN:
                raise _Raced from None
            raise
    elif partial.is_dir() and final.is_dir() and not final.is_symlink() and _exchange(partial, final):
        shutil.rmtree(partial)  # now holds the old checkpoint
    else:
        aside = _aside(final)
        try:
            os.rename(final, aside)
        except FileNotFoundError:
            raise _Raced from None
        try:
            _rename(partial, final)
        except _Raced:
            _delete(aside)
            raise
        except OSError:
            with contextlib.suppress(OSError):
                os.rename(aside, final)  # the old checkpoint back in place
            raise
        _delete(aside)


def commit(partial: Path, final: Path) -> None:
    """Move a finished ``partial`` checkpoint (file or directory) to ``final``, replacing what was there."""
    for _ in range(_COMMIT_TRIES):
        try:
            _commit_once(partial, final)
            break
        except _Raced:
            continue
    else:
        raise CheckpointWriteError(
            errno.EBUSY,
            f"{final}: another run keeps replacing this checkpoint while this one commits "
            f"its own ({partial.name} is left in place)",
        )
    fsync_dir(final.parent)


def remove(path: Path) -> None:
    """Delete a checkpoint: a link is unlinked, a directory is renamed out of sight before it is deleted. One that
    is already gone (another run removed it meanwhile) is no error."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        aside = _aside(path)
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        shutil.rmtree(aside)
