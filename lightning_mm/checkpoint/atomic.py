"""Making a checkpoint visible only once it is complete, and removing one without leaving half of it.

A checkpoint is written to a hidden sibling ``.<name>.partial-<token>`` and renamed into place when every rank
has finished. A hidden name never matches ModelCheckpoint's ``last``/``*.ckpt`` patterns, so ``ckpt_path="last"``
cannot pick up an interrupted save. Replacing an existing checkpoint directory (``save_last=True`` overwrites
``last.ckpt``) swaps the two directories in one ``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere the old one is
moved aside first, so that at every moment either the old or the new checkpoint is complete on disk.

The token of a partial names its writer: ``<host>-<pid>-<start>-<random>`` (a hash of the host name and boot,
the writing process and its start time). :func:`abandoned_partials` finds the partials, of any checkpoint name in
a directory, whose writer is this process (its saves run one at a time, so none of them is still being written)
or a process of this host (and process-id namespace) that no longer runs: a killed run's leftovers. A partial
written from another host or container, or by a process that still runs, is never one of them.
"""

from __future__ import annotations

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
from pathlib import Path

__all__ = ["partial_path", "stale_partials", "abandoned_partials", "commit", "remove", "fsync_dir"]

_PARTIAL = ".partial-"
_REMOVING = ".removing-"
_OWNED = re.compile(r"^\..+\.partial-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-[0-9a-f]{8}$")


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


def partial_path(final: Path, token: str | None = None) -> Path:
    """The hidden sibling a checkpoint is written to before :func:`commit` (its token names this process)."""
    return final.parent / f".{final.name}{_PARTIAL}{token or f'{_owner()}-{uuid.uuid4().hex[:8]}'}"


def stale_partials(final: Path) -> list[Path]:
    """Leftovers of interrupted saves of ``final`` (and of interrupted removals)."""
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


def abandoned_partials(directory: Path) -> list[Path]:
    """Partials in ``directory`` (any checkpoint name) left by this process or by a process that is gone."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _PARTIAL in p.name and _abandoned(p.name))


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
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def _delete(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def commit(partial: Path, final: Path) -> None:
    """Move a finished ``partial`` checkpoint (file or directory) to ``final``, replacing what was there."""
    if final.is_symlink():  # e.g. a `last.ckpt` link of save_last="link": the link is replaced, not its target
        final.unlink()
    if not final.exists():
        os.rename(partial, final)
    elif partial.is_file() and final.is_file():
        os.replace(partial, final)
    elif partial.is_dir() and final.is_dir() and _exchange(partial, final):
        shutil.rmtree(partial)  # now holds the old checkpoint
    else:
        aside = final.parent / f".{final.name}{_REMOVING}{uuid.uuid4().hex[:12]}"
        os.rename(final, aside)
        os.rename(partial, final)
        _delete(aside)
    fsync_dir(final.parent)


def remove(path: Path) -> None:
    """Delete a checkpoint: a link is unlinked, a directory is renamed out of sight before it is deleted."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        aside = path.parent / f".{path.name}{_REMOVING}{uuid.uuid4().hex[:12]}"
        os.rename(path, aside)
        shutil.rmtree(aside)
