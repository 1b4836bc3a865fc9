"""Saves touch only their own partials (issue #14, point 2): a partial (or a removal) of a live process, of another
host, or without an owner survives a save, same-name ones included; those of this process and of processes that
are gone go; two processes saving one checkpoint name into one directory both succeed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mm.checkpoint import atomic, store

ROOT = Path(__file__).resolve().parents[1]
EXTRA = {"format_version": 1, "kind": "training", "world_size": 1, "rng_point": "next_batch", "hf": []}


def _token(pid: int, start: int | None = None) -> str:
    """The ownership record of a partial written by process ``pid`` of this host (forged for another process)."""
    return f"{atomic._host()}-{pid}-{(atomic._start_time(pid) or 1) if start is None else start}-0123abcd"


def _save(path: Path, fmt: str = "torch_dcp", background: bool = False) -> list[str]:
    net = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught, ThreadPoolExecutor(1) as executor:
        warnings.simplefilter("always")
        future = store.save(
            {"epoch": 0, "global_step": 0, "state_dict": net.state_dict()},
            path,
            fmt,
            EXTRA,
            None,
            background=executor if background else None,
        )
        if background:  # MMFSDP2Strategy(async_save=True): the write and the commit in the background
            future.result()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_same_name_partials_of_live_processes_other_hosts_and_unknown_owners_survive_a_save(tmp_path, background):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        final = tmp_path / "step=2.ckpt"
        running = atomic.partial_path(final, _token(alive.pid))  # another job on this host, still writing
        reused = atomic.partial_path(final, _token(alive.pid, start=atomic._start_time(alive.pid) + 1))
        dead = atomic.partial_path(final, _token(int(gone.stdout)))
        mine = atomic.partial_path(final)  # an earlier failed save of this process
        elsewhere = tmp_path / ".step=2.ckpt.partial-00000000-1-1-0123abcd"  # another host: cannot tell
        unknown = tmp_path / ".step=2.ckpt.partial-0123456789ab"  # no owner (an older version's naming)
        removing_live = tmp_path / f".step=2.ckpt.removing-{_token(alive.pid)}"  # another run deleting
        removing_dead = tmp_path / f".step=2.ckpt.removing-{_token(int(gone.stdout))}"
        for path in (running, reused, dead, mine, elsewhere, unknown, removing_live, removing_dead):
            path.mkdir()
            (path / "__0_0.distcp").write_bytes(b"x")
        messages = _save(final, background=background)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([running.name, elsewhere.name, unknown.name, removing_live.name, final.name])
        assert [m for m in messages if "another run is saving" in m] == [
            f"another run is saving step=2.ckpt here (host {os.uname().nodename}, pid {alive.pid}): the checkpoint "
            f"committed last replaces the other in {tmp_path}"
        ]
        assert (running / "__0_0.distcp").read_bytes() == b"x"  # untouched
        store.open_source(final)
    finally:
        alive.kill()
        alive.wait()


_SAVER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from lightning_mm.checkpoint import store
    directory, value, start = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    extra = {"format_version": 1, "kind": "training", "world_size": 1, "rng_point": "next_batch", "hf": []}
    state = {"epoch": 0, "global_step": 0, "state_dict": {"w": torch.full((64, 64), value)}}
    while time.time() < start:
        time.sleep(0.005)
    for _ in range(25):
        store.save(state, directory / "step=2.ckpt", "torch_dcp", extra, None)
        store.save(state, directory / "step=2.pt", "torch", extra, None)
""")


def test_two_processes_saving_one_checkpoint_name_into_one_directory_both_succeed(tmp_path):
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.time() + 8  # both have imported torch by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", _SAVER, str(tmp_path), str(v), str(start)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for v in (1.0, 2.0)
    ]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errors)
    for name in ("step=2.ckpt", "step=2.pt"):
        source = store.open_source(tmp_path / name)  # complete and consistent: one run's checkpoint, whole
        (weights,) = source.read_full(["state_dict/w"]).values() if source.is_dcp else [source._tensors["state_dict/w"]]
        assert torch.equal(weights, torch.full((64, 64), 1.0)) or torch.equal(weights, torch.full((64, 64), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=2.pt"]  # no leftovers


def test_a_commit_that_another_run_commits_the_same_name_into_meanwhile_retries_and_succeeds(tmp_path, monkeypatch):
    final = tmp_path / "step=2.ckpt"
    theirs, ours = atomic.partial_path(final, _token(1, 1)), atomic.partial_path(final)
    for path, value in ((theirs, "theirs"), (ours, "ours")):
        path.mkdir()
        (path / "data").write_text(value)
    real_rename = os.rename

    def rename_after_theirs(source, target):  # the other run's commit lands between our check and our rename
        if Path(target) == final and not final.exists():
            real_rename(theirs, final)
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename_after_theirs)
    atomic.commit(ours, final)  # before: OSError "Directory not empty"
    assert (final / "data").read_text() == "ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_removing_a_checkpoint_that_another_run_removed_meanwhile_is_no_error(tmp_path, monkeypatch):
    doomed = tmp_path / "step=2.ckpt"
    doomed.mkdir()
    real_rename = os.rename

    def removed_first(source, target):
        atomic.shutil.rmtree(doomed)  # the other run's removal
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", removed_first)
    atomic.remove(doomed)
    assert list(tmp_path.iterdir()) == []
