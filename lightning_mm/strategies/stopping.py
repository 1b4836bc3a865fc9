"""Stopping a multi-process run: a signal ends the signalled rank at once, and the other ranks within a bound.

Lightning's own SIGTERM handling does a ``broadcast`` inside the signal handler of the signalled rank. The other
ranks are in a different collective at that moment, so every rank waits for the process-group timeout (30
minutes), and the signalled rank finally exits with status 0 (``SIGTERMException`` is a ``SystemExit`` without a
code), which a scheduler reads as success. :class:`RunGuard` replaces that for the duration of one run:

* **Signal handler** (installed when a stage starts, after Lightning's; Lightning restores the previous handlers at
  teardown): SIGTERM is forwarded to the ranks this process launched, a handler the user had installed before the
  run is called, then ``SIGTERMException(128 + SIGTERM)`` is raised, so Lightning's ``on_exception`` hooks run and
  the process exits with status 143, not 0. No collective runs in the handler.
* **Watchdog thread**: the launching rank watches the ranks it started, a launched rank watches its launcher. When
  one of them is gone (a launched rank that exited with a non-zero status, or a launcher that vanished), this rank
  interrupts its main thread (Lightning's KeyboardInterrupt shutdown: hooks, teardown, exit status 1); if it has not
  finished its run ``stop_timeout`` seconds later (a collective with the dead peer can block until the process-group
  timeout on NCCL/HCCL), it terminates the ranks it launched and exits with status 1 without further cleanup. A rank
  whose run already fails on its own (``on_exception``) stops watching: its own error is the one reported.

Ranks started externally (torchrun, SLURM) get the signal handler only: their launcher watches them.
"""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["RunGuard", "SIGNAL_EXIT_STATUS", "PEER_LOST_EXIT_STATUS", "remember_children", "launched_children"]

SIGNAL_EXIT_STATUS = 128 + int(signal.SIGTERM)  # 143, what a shell reports for a process ended by SIGTERM
PEER_LOST_EXIT_STATUS = 1
_POLL_S = 0.2
_LAUNCHED: list[subprocess.Popen] = []  # every rank process this process launched (a later Trainer reuses them)


def remember_children(procs: list[subprocess.Popen]) -> None:
    """Record the rank processes a launcher of this process started."""
    _LAUNCHED.extend(p for p in procs if all(p is not q for q in _LAUNCHED))


def launched_children() -> list[subprocess.Popen]:
    """The rank processes this process launched, for this Trainer or an earlier one."""
    return list(_LAUNCHED)


class RunGuard:
    """Signal handling and peer watching for one run (from ``setup_environment`` to ``teardown``).

    Args:
        stop_timeout: seconds a rank waits, after it saw a peer process go, for its run to end on its own before it
            exits with status 1.
        children: returns the processes this rank launched (the launching rank), or ``None``.
        watch_parent: this rank was launched by another rank and stops when that one is gone.
    """

    def __init__(self, stop_timeout: float, children: Callable[[], list[subprocess.Popen]] | None = None,
                 watch_parent: bool = False) -> None:
        if stop_timeout <= 0:
            raise ValueError(f"stop_timeout must be a positive number of seconds, got {stop_timeout!r}")
        self.stop_timeout = float(stop_timeout)
        self._children = children or (lambda: [])
        self._parent = os.getppid() if watch_parent else None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.signalled: int | None = None
        # The handler in place before Lightning's (a user's own, say): still called first on SIGTERM.
        previous = signal.getsignal(signal.SIGTERM) if self.supported else None
        owner = getattr(previous, "__self__", None)
        self._previous = previous if callable(previous) and not isinstance(owner, RunGuard) else None

    @property
    def supported(self) -> bool:
        return sys.platform != "win32"

    def start(self) -> None:
        """Start watching the peer processes (a no-op on Windows)."""
        if not self.supported or self._thread is not None or (self._parent is None and not self._children()):
            return
        self._done.clear()
        self._thread = threading.Thread(target=self._watch, name="lightning-mm-run-guard", daemon=True)
        self._thread.start()

    def install_signal_handler(self) -> None:
        """Handle SIGTERM in this process (main thread only, as Python requires)."""
        if self.supported and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def stop(self) -> None:
        """The run is over: stop watching (the signal handler is restored by Lightning's teardown)."""
        self._done.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * _POLL_S)

    # ------------------------------------------------------------------------------------------------ internals
    def _forward(self, signum: int) -> None:
        for proc in self._children():
            if proc.poll() is None:
                proc.send_signal(signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> Any:
        self.signalled = signum
        self._forward(signum)
        if self._previous is not None:
            self._previous(signum, frame)
        raise SIGTERMException(128 + int(signum))

    def _peer_lost(self) -> str | None:
        for proc in self._children():
            code = proc.poll()
            if code is not None and code != 0:
                return f"the rank process {proc.pid} it launched exited with status {code}"
        if self._parent is not None and os.getppid() != self._parent:
            return f"the launching rank process {self._parent} is gone"
        return None

    def _watch(self) -> None:
        while not self._done.wait(_POLL_S):
            reason = self._peer_lost()
            if reason is None:
                continue
            print(f"lightning-mm: this rank (pid {os.getpid()}) stops because {reason}; it exits within "
                  f"{self.stop_timeout:g} s (MMFSDP2Strategy(stop_timeout=...))", file=sys.stderr, flush=True)
            self._forward(signal.SIGTERM)
            # A KeyboardInterrupt in the main thread: Lightning's graceful-shutdown path (hooks, teardown, exit 1).
            _thread.interrupt_main()
            if self._done.wait(self.stop_timeout):
                return
            self._forward(signal.SIGKILL)
            os._exit(PEER_LOST_EXIT_STATUS)  # blocked in a collective with the lost peer: no clean way out
