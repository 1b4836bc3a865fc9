"""Lightning conformance on 2 real CPU ranks (tests/scenarios/conformance_scenarios.py), in the style of Lightning's own
strategy tests: callbacks the strategy must honour or refuse, and how a run stops when one rank is signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.scenario_kit import read_results, run, start
from tests.scenarios import conformance_scenarios

STOP_TIMEOUT = 5  # MMFSDP2Strategy(stop_timeout=5) in the sigterm scenario
MARGIN = 25  # process start-up and teardown on a loaded 2-core machine


def test_swa_is_refused_sync_batchnorm_converts_and_the_store_listens_on_loopback(tmp_path):
    run(conformance_scenarios.callbacks, tmp_path)
    for rank, out in enumerate(read_results(tmp_path, "callbacks")):
        # StochasticWeightAveraging: a clear error at setup, before any batch (it used to crash at swa_epoch_start).
        assert out["swa"].startswith(
            "MisconfigurationException: MMFSDP2Strategy does not support the StochasticWeightAveraging callback"
        )
        assert out["swa_batches"] == 0
        # Without sync_batchnorm the BatchNorm layers stay per-rank and training runs.
        assert out["plain_norms"] == ["BatchNorm1d"] and out["plain_batches"] == 4
        # Trainer(sync_batchnorm=True): converted, as Lightning's DDP/FSDP do, with the CPU warning on rank 0;
        # torch's SyncBatchNorm then refuses a CPU training forward.
        assert out["layer_sync"] == "TorchSyncBatchNorm"
        assert out["sync_norms"] == ["SyncBatchNorm"]
        assert out["sync_fit"].startswith("ValueError: SyncBatchNorm expected input tensor to be on GPU")
        if rank == 0:
            assert len(out["sync_warnings"]) == 1 and "will fail on CPU" in out["sync_warnings"][0]
        # A single-node run's rendezvous store listens on 127.0.0.1 only (hex as in /proc/net/tcp).
        if out["store_listens_on"] is not None:
            assert out["store_listens_on"] == ["0100007F"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("signalled", [1, 0])
def test_sigterm_to_one_rank_stops_every_rank_within_the_bound_and_non_zero(tmp_path, signalled):
    log = (tmp_path / "log").open("w")  # a file, not a pipe that nobody reads while the ranks run
    proc = start(conformance_scenarios.sigterm, tmp_path, stdout=log, stderr=subprocess.STDOUT)
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            for r in (0, 1):
                f = tmp_path / f"pid.rank{r}"
                if f.exists() and f.read_text():
                    pids[r] = int(f.read_text())
            time.sleep(0.2)
        assert len(pids) == 2, f"training did not start: {proc.poll()}"
        time.sleep(1.0)  # a few steps into training
        os.kill(pids[signalled], signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=STOP_TIMEOUT + MARGIN)
        while _alive(pids[1]) and time.monotonic() - sent < STOP_TIMEOUT + MARGIN:
            time.sleep(0.1)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
        output = (tmp_path / "log").read_text()
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not _alive(pids[1]), f"rank 1 still runs {elapsed:.0f} s after the signal\n{output[-4000:]}"
    assert elapsed < STOP_TIMEOUT + MARGIN
    # Neither rank reports success: 143 (SIGTERM) for a signalled rank, non-zero for the one that lost its peer.
    assert proc.returncode != 0, output[-4000:]
    assert (tmp_path / f"user_handler.rank{signalled}").read_text() == "called"  # the user's own handler ran
    child = (tmp_path / "child_status").read_text()
    assert child not in ("0", "running"), output[-4000:]
    if signalled == 1:
        assert child == "143", output[-4000:]
    else:
        assert proc.returncode == 143, output[-4000:]
