"""Stopping a multi-process run: a signal ends the signalled rank, and the other ranks, within a bound.

Lightning's own SIGTERM handling does a ``broadcast`` inside the signal handler of the signalled rank. The other
ranks are in a different collective at that moment, so every rank waits for the process-group timeout (30
minutes), and the signalled rank finally exits with status 0 (``SIGTERMException`` is a ``SystemExit`` without a
code), which a scheduler reads as success. :class:`RunGuard` replaces that for the duration of one run (from
``setup_environment`` to the end of ``teardown``):

* **Signal handler** (installed when a stage starts, after Lightning's; Lightning restores the previous handlers at
  teardown): SIGTERM is forwarded to the ranks this process launched, a handler the user had installed before the
  run is called, then ``SIGTERMException(128 + SIGTERM)`` is raised, so Lightning's ``on_exception`` hooks run and
  the process exits with status 143, not 0. No collective runs in the handler. SIGINT keeps Python's handler
  (``KeyboardInterrupt``: Lightning's graceful shutdown, exit status 1).
* **Signal deadline**: Python runs a signal handler only when the main thread comes back to the interpreter, which a
  main thread blocked in a collective (a peer that hangs), or in any other long C call, does not do. The C-level
  part of Python's signal handling still writes the signal number to the descriptor of ``signal.set_wakeup_fd``
  at once, whatever the main thread does; a watcher thread reads it. On SIGTERM it forwards the signal to the
  ranks this process launched; on SIGTERM or SIGINT it arms a deadline: if the run has not ended ``stop_timeout``
  seconds later (the graceful path finished, or could not even start), the watcher kills the ranks this process
  launched (SIGKILL) and ends the process with ``os._exit``: status 143 after SIGTERM, 130 after SIGINT. The
  deadline holds through ``on_exception`` hooks and teardown, and ends when the run's teardown has finished. A
  process-level cleanup that did not happen then (a checkpoint being written) is left to the next run: an atomic
  save leaves only a hidden partial, which the next save in that directory removes.
* **Peer watching**: the launching rank watches the ranks it started, a launched rank watches its launcher. When
  one of them is gone (a launched rank that exited with a non-zero status, or a launcher that vanished), this rank
  interrupts its main thread (Lightning's KeyboardInterrupt shutdown: hooks, teardown, exit status 1); if it has not
  finished its run ``stop_timeout`` seconds later (a collective with the dead peer can block until the process-group
  timeout on NCCL/HCCL), it terminates the ranks it launched and exits with status 1 without further cleanup. A rank
  whose run already fails on its own (``on_exception``) stops watching its peers: its own error is the one reported.

Ranks started externally (torchrun, SLURM) get the signal handler and the signal deadline: their launcher watches
them. A C call that holds the GIL while it blocks (blocking calls release it: collectives, sleeps, I/O) stops every
Python thread, the watcher's too; only the launcher (or SIGKILL) ends such a process. Signal deadlines need the
main thread (``signal.set_wakeup_fd``) and POSIX; elsewhere only the handler and peer watching apply.
"""

from __future__ import annotations

import _thread
import math
import numbers
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_mm.errors import ConfigError, InputTypeError

__all__ = [
    "RunGuard",
    "SIGNAL_EXIT_STATUS",
    "INTERRUPT_EXIT_STATUS",
    "PEER_LOST_EXIT_STATUS",
    "check_stop_timeout",
    "remember_children",
    "launched_children",
    "start_run_guard",
    "StrategyRuns",
]

SIGNAL_EXIT_STATUS = 128 + int(signal.SIGTERM)  # 143, what a shell reports for a process ended by SIGTERM
INTERRUPT_EXIT_STATUS = 128 + int(signal.SIGINT)  # 130, a SIGINT whose graceful shutdown did not finish in time
PEER_LOST_EXIT_STATUS = 1
_POLL_S = 0.2
_STOP_SIGNALS = (int(signal.SIGTERM), int(signal.SIGINT))
_LAUNCHED: list[subprocess.Popen] = []  # every rank process this process launched (a later Trainer reuses them)


def check_stop_timeout(value: Any) -> float:
    """``value`` as seconds, when it is a positive finite number a thread can wait for; a clear error otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"stop_timeout must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not (math.isfinite(seconds) and 0 < seconds <= threading.TIMEOUT_MAX):
        raise ConfigError(
            f"stop_timeout must be a positive, finite number of seconds (at most "
            f"{threading.TIMEOUT_MAX:g}), got {value!r}"
        )
    return seconds


def remember_children(procs: list[subprocess.Popen]) -> None:
    """Record the rank processes a launcher of this process started."""
    _LAUNCHED.extend(p for p in procs if all(p is not q for q in _LAUNCHED))


def launched_children() -> list[subprocess.Popen]:
    """The rank processes this process launched, for this Trainer or an earlier one."""
    return list(_LAUNCHED)


_ACTIVE_PIPES: dict[int, int] = {}  # write descriptor of each open wakeup pipe -> the wakeup descriptor before it


def _forget_pipes_in_child() -> None:
    """In a forked child (a DataLoader worker): its signals are not this run's; the wakeup descriptor goes back."""
    if not _ACTIVE_PIPES:
        return
    try:
        current = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(_ACTIVE_PIPES.get(current, current))
    except (ValueError, OSError):  # forked from another thread than the main one: nothing to put back
        pass
    _ACTIVE_PIPES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pipes_in_child)


class _WakeupPipe:
    """``signal.set_wakeup_fd`` on a pipe of ours, restored at :meth:`close`; signal numbers that arrive are also
    passed on to a wakeup descriptor that was there before (an event loop's). A forked child does not keep it."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        try:
            self.previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread, or a platform without it
            os.close(self.read_fd)
            os.close(self.write_fd)
            raise
        _ACTIVE_PIPES[self.write_fd] = self.previous

    def read(self, timeout: float) -> bytes:
        """The signal numbers that arrived (waits up to ``timeout`` seconds for one)."""
        try:
            ready, _, _ = select.select([self.read_fd], [], [], timeout)
        except (OSError, ValueError):  # closed meanwhile
            return b""
        if not ready:
            return b""
        try:
            data = os.read(self.read_fd, 512)
        except (BlockingIOError, OSError):
            return b""
        if data and self.previous >= 0:
            try:
                os.write(self.previous, data)
            except OSError:
                pass
        return data

    def close(self) -> None:
        """Put back the previous wakeup descriptor (main thread only; elsewhere ours stays until the next guard)."""
        if threading.current_thread() is threading.main_thread():
            _ACTIVE_PIPES.pop(self.write_fd, None)
            try:
                current = signal.set_wakeup_fd(self.previous)
                if current != self.write_fd:  # someone replaced ours since: theirs stays
                    signal.set_wakeup_fd(current)
            except (ValueError, OSError):
                pass
            for fd in (self.read_fd, self.write_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass


class RunGuard:
    """Signal handling, the signal deadline and peer watching for one run (from ``setup_environment`` to
    ``teardown``).

    Args:
        stop_timeout: seconds within which this rank's run ends after a SIGTERM or SIGINT, or after it saw a peer
            process go, before it exits without further cleanup (:func:`check_stop_timeout`).
        children: returns the processes this rank launched (the launching rank), or ``None``.
        watch_parent: this rank was launched by another rank and stops when that one is gone.
    """

    def __init__(
        self,
        stop_timeout: float,
        children: Callable[[], list[subprocess.Popen]] | None = None,
        watch_parent: bool = False,
    ) -> None:
        self.stop_timeout = check_stop_timeout(stop_timeout)
        self._children = children or (lambda: [])
        self._parent = os.getppid() if watch_parent else None
        self._done = threading.Event()
        self._watch_peers = True
        self._thread: threading.Thread | None = None
        self._wakeup: _WakeupPipe | None = None
        self._forwarded: set[int] = set()
        self._deadline: float | None = None  # time.monotonic() by which the run must have ended
        self._exit_status = PEER_LOST_EXIT_STATUS
        self._reason = ""
        self.signalled: int | None = None
        # The handler in place before Lightning's (a user's own, say): still called first on SIGTERM.
        previous = signal.getsignal(signal.SIGTERM) if self.supported else None
        owner = getattr(previous, "__self__", None)
        self._previous = previous if callable(previous) and not isinstance(owner, RunGuard) else None

    @property
    def supported(self) -> bool:
        return sys.platform != "win32"

    def start(self) -> None:
        """Start the watcher: signal deadlines (from the main thread) and peer processes (a no-op on Windows)."""
        if not self.supported or self._thread is not None:
            return
        if threading.current_thread() is threading.main_thread():
            try:
                self._wakeup = _WakeupPipe()
            except (ValueError, OSError):
                self._wakeup = None
        if self._wakeup is None and self._parent is None and not self._children():
            return
        self._done.clear()
        self._thread = threading.Thread(target=self._watch, name="lightning-mm-run-guard", daemon=True)
        self._thread.start()

    def install_signal_handler(self) -> None:
        """Handle SIGTERM in this process (main thread only, as Python requires)."""
        if self.supported and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def failed(self) -> None:
        """This rank's run fails on its own: stop watching the peers (a signal deadline already armed holds)."""
        self._watch_peers = False

    def stop(self) -> None:
        """The run is over: stop watching (the signal handler is restored by Lightning's teardown)."""
        self._done.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * _POLL_S)
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _forward(self, signum: int) -> None:
        for proc in self._children():
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except OSError:
                    pass

    def _forward_once(self, signum: int) -> None:
        if signum not in self._forwarded:
            self._forwarded.add(signum)
            self._forward(signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> Any:
        self.signalled = signum
        self._forward_once(signum)
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

    def _arm(self, status: int, reason: str) -> None:
        self._deadline = time.monotonic() + self.stop_timeout
        self._exit_status, self._reason = status, reason

    def _on_signal_number(self, signum: int) -> None:
        if signum not in _STOP_SIGNALS or self._deadline is not None:
            return  # another signal, or a stop already under way (its deadline and status stay)
        self.signalled = self.signalled or signum
        if signum == signal.SIGTERM:
            self._forward_once(signum)
            self._arm(SIGNAL_EXIT_STATUS, "SIGTERM")
        else:
            self._arm(INTERRUPT_EXIT_STATUS, "SIGINT")

    def _watch(self) -> None:
        while not self._done.is_set():
            if self._wakeup is not None:
                for signum in self._wakeup.read(_POLL_S):
                    self._on_signal_number(signum)
            else:
                self._done.wait(_POLL_S)
            if self._done.is_set():
                return
            if self._deadline is None and self._watch_peers:
                reason = self._peer_lost()
                if reason is not None:
                    print(
                        f"lightning-mm: this rank (pid {os.getpid()}) stops because {reason}; it exits within "
                        f"{self.stop_timeout:g} s (MMFSDP2Strategy(stop_timeout=...))",
                        file=sys.stderr,
                        flush=True,
                    )
                    self._arm(PEER_LOST_EXIT_STATUS, reason)
                    self._forward_once(signal.SIGTERM)
                    # A KeyboardInterrupt in the main thread: Lightning's graceful-shutdown path (hooks, teardown,
                    # exit 1). Its SIGINT reaches the wakeup descriptor too; the deadline is armed already.
                    _thread.interrupt_main()
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._exit_now()

    def _exit_now(self) -> None:
        """The run did not end within ``stop_timeout``: blocked (in a collective with a lost or hung peer, in a C
        call); no clean way out. The message goes straight to descriptor 2: the main thread may hold the lock of
        ``sys.stderr`` (or of ``sys.stdout``) while it is blocked."""
        try:
            launched = self._children()
            self._forward(signal.SIGKILL)
            ends = []
            for proc in launched:
                try:
                    ends.append(f"pid {proc.pid} status {proc.wait(timeout=1)}")
                except (subprocess.TimeoutExpired, OSError):
                    ends.append(f"pid {proc.pid} still running")
            os.write(
                2,
                (
                    f"lightning-mm: this rank (pid {os.getpid()}) did not finish its run within "
                    f"{self.stop_timeout:g} s of {self._reason} (its main thread is blocked); it exits with "
                    f"status {self._exit_status} without further cleanup (MMFSDP2Strategy(stop_timeout=...))"
                    f"{'; the ranks it launched: ' + ', '.join(ends) if ends else ''}\n"
                ).encode(),
            )
        finally:
            os._exit(self._exit_status)


def start_run_guard(previous: RunGuard | None, env: Any, launcher: Any, stop_timeout: float) -> RunGuard:
    """Stop ``previous`` and watch the other rank processes of this run: the children ``launcher`` started, and,
    on a rank that Lightning's launcher started (a ``LightningEnvironment`` rank > 0), that launcher."""
    if previous is not None:
        previous.stop()
    remember_children(list(getattr(launcher, "procs", None) or []))
    launched = type(env) is LightningEnvironment and env.creates_processes_externally and env.local_rank() > 0
    guard = RunGuard(stop_timeout, children=launched_children, watch_parent=launched)
    guard.start()
    return guard


class StrategyRuns:
    """A strategy's runs, one at a time (``setup_environment`` to ``teardown``): the :class:`RunGuard` of the run
    under way and whether that run failed.

    Args:
        stop_timeout: see :class:`RunGuard` (:func:`check_stop_timeout`).
    """

    def __init__(self, stop_timeout: Any) -> None:
        self.stop_timeout = check_stop_timeout(stop_timeout)
        self.guard: RunGuard | None = None
        self.failed = False
        """Whether the run under way failed (``on_exception``); reset by :meth:`end`."""

    def start(self, env: Any, launcher: Any) -> None:
        """A run starts: stop the previous run's guard and watch this one's peers (:func:`start_run_guard`)."""
        self.guard = start_run_guard(self.guard, env, launcher, self.stop_timeout)

    def install_signal_handler(self) -> None:
        """When a stage starts, after Lightning's handler: SIGTERM ends this rank without a collective."""
        if self.guard is not None:
            self.guard.install_signal_handler()

    def fail(self, exception: BaseException) -> None:
        """The run fails on this rank: its own error, not a peer's loss, is reported; a signal's exit status is
        never 0."""
        self.failed = True
        if self.guard is not None:
            self.guard.failed()
        if isinstance(exception, SIGTERMException) and not exception.code:
            exception.code = SIGNAL_EXIT_STATUS

    def end(self) -> None:
        """The run's teardown has finished: stop watching."""
        self.failed = False
        if self.guard is not None:
            self.guard.stop()
            self.guard = None
