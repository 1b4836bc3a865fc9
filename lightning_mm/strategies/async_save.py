"""Saving in the background (``MMFSDP2Strategy(async_save=True)``): what the strategy keeps between a save's start
and its completion.

``lightning_mm.checkpoint.writer.save(..., background=...)`` stages the state and returns a future; the write, the
manifest and the atomic commit run in a daemon thread, their collectives on a gloo process group of their own
(created once, by every rank at its first background save) so that they never interleave with training's. Until
the future completes, nothing of the checkpoint is visible, and:

* the next save, a load, ``on_train_end`` and ``teardown`` wait for it (:meth:`AsyncSaver.wait`), raising what the
  write raised, on every rank (the write's outcome is shared by its own collectives);
* ``save_top_k`` deletions (``strategy.remove_checkpoint``) are deferred until it completes
  (:meth:`AsyncSaver.defer_removal`): a crash never leaves fewer complete checkpoints than before the save;
* a ``last`` link that ModelCheckpoint (``save_last="link"``) points at it is turned back to its previous
  (complete) target, or removed if it had none, in the ``strategy.barrier()`` ModelCheckpoint calls right after
  linking (:meth:`AsyncSaver.hide_links`), and pointed at the checkpoint once that is in place. So ``last`` always
  names a complete checkpoint, also after a kill during the write.

The state is staged into buffers kept from one save to the next (:class:`.writer.Staging`, one per checkpoint key):
a save refills the copies the previous one wrote from (complete by then: each save waits for the one before) instead
of allocating new ones. They live as long as this saver (the run). Before the copy, the ranks agree on the save's
refusals in one collective on the save's group; the gather of the ranks' entries, the partial and the write follow
in the background.

A failed run (an error, SIGTERM) gives a pending write up to ``stop_timeout`` to complete (then finishes it) and
otherwise abandons it: its partial stays hidden and is removed by a later save once this process is gone.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_mm.checkpoint import atomic
from lightning_mm.checkpoint.writer import Staging

__all__ = ["AsyncSaver"]


class _DaemonThreads(Executor):
    """Runs each task in a daemon thread: an abandoned write (a peer gone) never holds the interpreter's exit."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # handed to whoever waits
                future.set_exception(error)

        threading.Thread(target=run, name="lightning-mm-checkpoint-save", daemon=True).start()
        return future


@dataclass
class _Pending:
    path: Path
    future: Future
    rank0: bool
    links_before: dict[str, str]  # link name in the checkpoint's directory -> its target when the save started
    hidden: dict[Path, str] = field(default_factory=dict)  # links turned away from the pending checkpoint
    removals: list[Path] = field(default_factory=list)


def _links(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        return {}
    return {p.name: os.readlink(p) for p in directory.iterdir() if p.is_symlink()}


def _same(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _relink(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` in one rename (never a moment without a link)."""
    temporary = link.parent / f".{link.name}.relink-{uuid.uuid4().hex[:8]}"
    os.symlink(target, temporary)
    os.replace(temporary, link)


class AsyncSaver:
    """The strategy's background save: at most one at a time (see the module docstring)."""

    def __init__(self) -> None:
        self._executor = _DaemonThreads()
        self._group: Any = None
        self._pending: _Pending | None = None
        self._staging = Staging()

    @property
    def pending(self) -> Path | None:
        return self._pending.path if self._pending is not None else None

    def start(
        self,
        path: Path,
        rank0: bool,
        save: Callable[[Executor, Any, Staging], Future | None],
        timeout: timedelta | None,
    ) -> None:
        """Start ``save(executor, group, staging)`` (every rank, after :meth:`wait`): the state is staged (into
        ``staging``'s buffers, reused from the previous save) when it returns."""
        assert self._pending is None, "wait() for the previous save first"
        if self._group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=timeout)  # None: the default timeout
        links = _links(path.parent) if rank0 else {}
        future = save(self._executor, self._group, self._staging)
        assert future is not None
        self._pending = _Pending(path, future, rank0, links)

    def hide_links(self) -> None:
        """Turn links to the pending checkpoint (made since it started) back to what they named before (rank 0)."""
        pending = self._pending
        if pending is None or not pending.rank0 or pending.future.done() or not pending.path.parent.is_dir():
            return
        for link in pending.path.parent.iterdir():
            if not link.is_symlink() or link in pending.hidden:
                continue
            target = os.readlink(link)
            if not _same(link.parent / target, pending.path):
                continue
            previous = pending.links_before.get(link.name)
            if (
                previous is not None
                and not _same(link.parent / previous, pending.path)
                and (link.parent / previous).exists()
            ):
                _relink(link, previous)
            else:
                link.unlink()
            pending.hidden[link] = target

    def defer_removal(self, path: Path) -> bool:
        """True when the removal of ``path`` is deferred until the pending save completes (rank 0)."""
        pending = self._pending
        if pending is None:
            return False
        if _same(path, pending.path):
            self.wait()
            return False
        pending.removals.append(path)
        return True

    def poll(self) -> None:
        """Finish a save that has completed without error (its links and deferred removals); no collective."""
        pending = self._pending
        if pending is not None and pending.future.done() and pending.future.exception() is None:
            self.wait()

    def wait(self) -> None:
        """Wait for the pending save; then point its links at it and do the deferred removals. A failed write is
        raised (its links stay at their previous targets, and nothing is removed)."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        pending.future.result()
        if not pending.rank0:
            return
        for link, target in pending.hidden.items():
            _relink(link, target)
        for path in pending.removals:
            atomic.remove(path)

    def settle(self, timeout: float) -> None:
        """After a failed run (an error, SIGTERM): give the pending write up to ``timeout`` seconds to complete, and
        finish it if it does (no data lost); otherwise, or if it failed, forget it (its partial stays hidden). A
        write left running when the interpreter exits would end the process with an abort, not its status."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.future.result(timeout=timeout)
        except BaseException:  # a timeout, or the write failed too: the run's own error is the one reported
            self._pending = None
            self._staging = Staging()  # the forgotten write may still read the old buffers: never refill them
            return
        self.wait()
