"""``lightning_mm.strategies.stopping`` in one process: ``stop_timeout`` is validated, and a signal takes effect
within it while the main thread is blocked in a C call (a small script in a subprocess: the watcher ends its
process)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_mm import MMFSDP2Strategy
from lightning_mm.strategies.stopping import RunGuard, check_stop_timeout

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0, -1.0, 1e300])
def test_stop_timeout_must_be_a_positive_finite_number(value):
    with pytest.raises(ValueError, match=r"stop_timeout must be a positive, finite number of seconds"):
        MMFSDP2Strategy(stop_timeout=value)
    with pytest.raises(ValueError, match=r"stop_timeout must be a positive, finite number"):
        RunGuard(value)


@pytest.mark.parametrize("value", [True, "30", None])
def test_stop_timeout_must_be_a_number(value):
    with pytest.raises(TypeError, match=r"stop_timeout must be a number of seconds"):
        MMFSDP2Strategy(stop_timeout=value)


def test_a_valid_stop_timeout_is_kept_in_seconds():
    assert MMFSDP2Strategy(stop_timeout=2).stop_timeout == 2.0 and check_stop_timeout(0.5) == 0.5


_BLOCKED = textwrap.dedent("""
    import os, sys, pathlib, torch
    from lightning_mm.strategies.stopping import RunGuard
    guard = RunGuard(1.0)
    guard.start()
    guard.install_signal_handler()
    pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
    torch.futures.Future().wait()  # a C++ wait that never ends: no Python signal handler can run
""")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_a_process_whose_main_thread_is_blocked_in_a_c_call(tmp_path, signum, status):
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED, str(ready)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), proc.communicate()[1]
        time.sleep(0.3)
        os.kill(proc.pid, signum)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)  # a hang guard: the exit code is what is checked
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, err
    assert 0.9 <= elapsed <= 4, elapsed  # the deadline (1 s), not at once and not never
    assert f"did not finish its run within 1 s of {signal.Signals(signum).name}" in err, err


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_does_not_report_its_signals_to_the_run_guard():
    import signal as sig

    from lightning_mm.strategies.stopping import _WakeupPipe

    pipe = _WakeupPipe()
    try:
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say: its SIGTERM/SIGINT must not arm the parent's deadline
            os._exit(0 if sig.set_wakeup_fd(-1) == -1 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        pipe.close()
    assert sig.set_wakeup_fd(-1) == -1  # put back as it was
