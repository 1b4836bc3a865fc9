"""A 2-rank fit over data with an image that passes the up-front check and fails to decode (issue #12, point 6);
2-rank runs with a rank that hangs, stopped by a signal within ``stop_timeout``
(tests/scenarios/hostile_scenarios.py)."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.hostile_files import write_captioning_data
from tests.helpers.scenario_kit import kill_job, read_results, run, start
from tests.scenarios import hostile_scenarios


def test_a_corrupt_pixel_stream_is_skipped_and_counted_in_a_two_rank_fit(tmp_path):
    write_captioning_data(tmp_path / "data", good=7, corrupt_line=3)
    run(hostile_scenarios.corrupt_image, tmp_path, timeout=240)
    ranks = read_results(tmp_path, "corrupt_image")
    assert [r["steps"] for r in ranks] == [4, 4]  # 8 records / 2 ranks / batch 2, 2 epochs: nothing lost, no hang
    problems = [p for r in ranks for p in r["problems"]]
    assert len(problems) == 1 and "train.jsonl:3: cannot decode image" in problems[0], problems


# --------------------------------------------------------------------------- a stop that always stops (issue #14, 1)
STOP_TIMEOUT = 3.0  # tests/scenarios/hostile_scenarios.py STOP_TIMEOUT
MARGIN = 6.0  # the watcher's poll, killing and reaping the ranks, on a loaded 2-core machine


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _signal_a_hanging_run(
    fn: Callable[[Path], None], outdir: Path, hung: int, target: int, signum: int
) -> tuple[int, dict[int, int], float, str]:
    """Start the scenario ``fn`` (rank ``hung`` blocks for good) in its own session, send ``signum`` to rank ``target``
    once rank ``hung`` blocks; returns rank 0's exit status, the ranks' pids, the seconds from the signal until
    no rank runs, and the output."""
    log = (outdir / "log").open("w")  # a file, not a pipe that nobody reads while the ranks run
    proc = start(fn, outdir, stdout=log, stderr=subprocess.STDOUT)
    pids: dict[int, int] = {}
    elapsed = float("inf")
    try:
        deadline = time.monotonic() + 240
        marker = outdir / f"hung.rank{hung}"
        while time.monotonic() < deadline and proc.poll() is None and not (len(pids) == 2 and marker.exists()):
            for r in (0, 1):
                f = outdir / f"pid.rank{r}"
                if r not in pids and f.exists() and f.read_text():
                    pids[r] = int(f.read_text())
            time.sleep(0.2)
        assert len(pids) == 2 and marker.exists(), f"rank {hung} did not block: {proc.poll()}"
        time.sleep(1.0)  # the other rank reaches its next collective
        os.kill(pids[target], signum)
        sent = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT + MARGIN)
        while any(_alive(p) for p in pids.values()) and time.monotonic() - sent < STOP_TIMEOUT + MARGIN:
            time.sleep(0.05)
        if not any(_alive(p) for p in pids.values()) and proc.poll() is not None:
            elapsed = time.monotonic() - sent
    finally:
        kill_job(proc)  # whatever is left of that session
        proc.wait()
        log.close()
    return proc.returncode, pids, elapsed, (outdir / "log").read_text()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_to_rank_zero_blocked_in_a_collective_with_a_hung_peer_ends_every_rank_in_time(tmp_path):
    status, pids, elapsed, output = _signal_a_hanging_run(
        hostile_scenarios.hang_collective, tmp_path, hung=1, target=0, signum=signal.SIGTERM
    )
    # Without a watcher independent of the main thread, rank 0 sat in its gloo wait until the 30-minute timeout.
    assert elapsed <= STOP_TIMEOUT + MARGIN, f"ranks ran {STOP_TIMEOUT + MARGIN} s after SIGTERM\n{output[-3000:]}"
    assert status == 143, output[-4000:]
    assert f"pid {pids[0]}) did not finish its run within 3 s of SIGTERM" in output, output[-4000:]
    child = re.search(rf"the ranks it launched: pid {pids[1]} status (-?\d+)", output)
    assert child is not None and int(child[1]) != 0, output[-4000:]  # 143 on its own, or -9 from rank 0


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_to_the_rank_hung_in_a_c_call_ends_every_rank_in_time(tmp_path):
    status, pids, elapsed, output = _signal_a_hanging_run(
        hostile_scenarios.hang_c_call, tmp_path, hung=1, target=1, signum=signal.SIGTERM
    )
    assert elapsed <= STOP_TIMEOUT + MARGIN, f"ranks ran {STOP_TIMEOUT + MARGIN} s after SIGTERM\n{output[-3000:]}"
    # The signalled rank: 143; rank 0, whose collective lost its peer: non-zero.
    assert (
        f"pid {pids[1]}) did not finish its run within 3 s of SIGTERM (its main thread is blocked); it exits "
        "with status 143" in output
    ), output[-4000:]
    assert status not in (0, None), output[-4000:]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_to_rank_zero_blocked_during_setup_ends_every_rank_in_time(tmp_path):
    status, pids, elapsed, output = _signal_a_hanging_run(
        hostile_scenarios.hang_setup, tmp_path, hung=0, target=0, signum=signal.SIGINT
    )
    assert elapsed <= STOP_TIMEOUT + MARGIN, f"ranks ran {STOP_TIMEOUT + MARGIN} s after SIGINT\n{output[-3000:]}"
    assert status == 130, output[-4000:]  # 128 + SIGINT: the KeyboardInterrupt could not be raised in time
    child = re.search(rf"the ranks it launched: pid {pids[1]} status (-?\d+)", output)
    assert child is not None and int(child[1]) != 0, output[-4000:]
