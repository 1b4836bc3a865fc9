"""The one protocol of the multi-rank scenario scripts, and the one launcher the tests start them with.

A scenario script ``tests/scenarios/<area>_scenarios.py`` registers its acts with :func:`scenario` and ends with::

    if __name__ == "__main__":
        main()

Its command line is always ``python tests/scenarios/<area>_scenarios.py SCENARIO WORKDIR [--arg key=value ...]``:
:func:`main` creates ``WORKDIR``, sets one intra-op thread, calls the registered function as ``fn(Path(WORKDIR),
key=value, ...)`` (values are strings) on every rank, then ends the process through
``tests/helpers/scenario_exit.py::exit_cleanly`` (unless the scenario was registered with ``exit_cleanly=False``: one
that kills itself or ends on its own terms). Every rank writes what it observed with :func:`write_result`
(``WORKDIR/NAME.rank{R}.json``); the test reads it back with
:func:`read_results`.

A test starts a scenario with :func:`run` (or :func:`start`, where it must signal a running job), naming the
function itself: ``run(ckpt_scenarios.resume, tmp_path)``. The ranks are started by

* ``launcher="lightning"`` (the default): one process; the scenario's ``Trainer(devices=N)`` re-runs the script for
  the other ranks (Lightning's own launcher), so the command line is the same on every rank;
* ``launcher="torchrun"``: ``python -m torch.distributed.run --standalone --nproc-per-node N`` for plain
  ``torch.distributed`` code (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment);
* ``launcher="per_rank"``: N processes started here, as an external launcher does (``LOCAL_RANK``, ``NODE_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT`` of a free port), for a test that needs each rank's own exit status and output:
  :func:`run` then returns one finished process per rank.

Nothing distributed runs in the pytest process: this module is imported there only for its launcher half.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("lightning", "torchrun", "per_rank")

# module name -> scenario name -> function; a script run directly registers under "__main__"
_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {}


# ------------------------------------------------------------------------------------------ the script side
def scenario(fn: Callable[..., Any] | None = None, *, exit_cleanly: bool = True) -> Any:
    """Register ``fn`` under its own name as a scenario of its module (``@scenario`` or ``@scenario(...)``).

    ``exit_cleanly=False``: :func:`main` returns normally after ``fn`` (for a scenario that kills itself, or that
    decides how its process ends)."""

    def register(f: Callable[..., Any]) -> Callable[..., Any]:
        registry = _REGISTRY.setdefault(f.__module__, {})
        if f.__name__ in registry:
            raise ValueError(f"scenario {f.__name__!r} registered twice in {f.__module__}")
        f.scenario_name = f.__name__  # type: ignore[attr-defined]
        f.scenario_exit_cleanly = exit_cleanly  # type: ignore[attr-defined]
        registry[f.__name__] = f
        return f

    return register(fn) if fn is not None else register


def scenarios(module: str = "__main__") -> dict[str, Callable[..., Any]]:
    """The scenarios registered by ``module`` (by name)."""
    return dict(_REGISTRY.get(module, {}))


def parse_argv(argv: list[str]) -> tuple[str, Path, dict[str, str]]:
    """``SCENARIO WORKDIR [--arg key=value ...]`` -> (name, workdir, args)."""
    usage = "usage: SCENARIO WORKDIR [--arg key=value ...]"
    if len(argv) < 2 or argv[0].startswith("-") or argv[1].startswith("-"):
        raise SystemExit(f"{usage}; got {argv}")
    name, workdir, rest = argv[0], Path(argv[1]), argv[2:]
    args: dict[str, str] = {}
    while rest:
        if rest[0] != "--arg" or len(rest) < 2 or "=" not in rest[1]:
            raise SystemExit(f"{usage}; cannot read {rest}")
        key, value = rest[1].split("=", 1)
        if not key.isidentifier() or key in args:
            raise SystemExit(f"{usage}; bad or repeated key {key!r}")
        args[key] = value
        rest = rest[2:]
    return name, workdir, args


def main(argv: list[str] | None = None, module: str = "__main__") -> None:
    """Run the scenario that the command line names (see the module docstring) and end the process."""
    name, workdir, args = parse_argv(sys.argv[1:] if argv is None else argv)
    registry = _REGISTRY.get(module, {})
    if name not in registry:
        raise SystemExit(f"unknown scenario {name!r}; this script has {sorted(registry)}")
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    fn = registry[name]
    fn(workdir, **args)
    if fn.scenario_exit_cleanly:
        from tests.helpers.scenario_exit import exit_cleanly

        exit_cleanly()


def current_rank() -> int:
    """This process's global rank: the process group's where there is one, else the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def write_result(workdir: str | Path, name: str, payload: Any, rank: int | None = None) -> Path:
    """Write ``payload`` as JSON to ``WORKDIR/NAME.rank{R}.json`` (``R``: ``rank``, else :func:`current_rank`)."""
    path = Path(workdir) / f"{name}.rank{current_rank() if rank is None else rank}.json"
    path.write_text(json.dumps(payload))
    return path


# ------------------------------------------------------------------------------------------ the test side
def read_results(workdir: str | Path, name: str, ranks: int = 2) -> list[dict]:
    """What every rank of ``name`` wrote with :func:`write_result`, by rank."""
    return [json.loads((Path(workdir) / f"{name}.rank{r}.json").read_text()) for r in range(ranks)]


def scenario_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a scenario process: this checkout first on ``PYTHONPATH``, one OpenMP thread, and no
    ``LOCAL_RANK`` (the launcher assigns ranks); then ``extra`` (a value of None removes the variable)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _target(target: Callable[..., Any] | str, script: str | Path | None) -> tuple[str, Path]:
    if isinstance(target, str):
        if script is None:
            raise TypeError(f"scenario {target!r} named by a string needs script=")
        return target, Path(script)
    name = getattr(target, "scenario_name", None)
    if name is None:
        raise TypeError(f"{target!r} is not registered with @scenario")
    module = sys.modules[target.__module__]
    path = Path(script) if script is not None else Path(module.__file__)
    if _REGISTRY.get(target.__module__, {}).get(name) is not target:
        raise TypeError(f"{target!r} is not the scenario {name!r} of {target.__module__}")
    return name, path


def command(
    target: Callable[..., Any] | str,
    workdir: str | Path,
    *,
    args: Mapping[str, Any] | None = None,
    launcher: str = "lightning",
    nproc: int = 2,
    script: str | Path | None = None,
) -> list[str]:
    """The command line that starts ``target`` (a registered scenario function, or its name with ``script=``); with
    ``launcher="per_rank"``, the command line of each rank."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: one of {LAUNCHERS}")
    name, path = _target(target, script)
    argv = [str(path), name, str(workdir)]
    for key, value in (args or {}).items():
        argv += ["--arg", f"{key}={value}"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *argv]
    return [sys.executable, *argv]


def start(
    target: Callable[..., Any] | str,
    workdir: str | Path,
    *,
    args: Mapping[str, Any] | None = None,
    launcher: str = "lightning",
    nproc: int = 2,
    script: str | Path | None = None,
    env: Mapping[str, str | None] | None = None,
    **popen: Any,
) -> subprocess.Popen:
    """Start the scenario in its own session (so that :func:`kill_job` reaches every rank) and return the process;
    ``popen`` goes to :class:`subprocess.Popen` (default: stdout and stderr captured, as text)."""
    if launcher == "per_rank":
        raise ValueError("start() starts one job; run(..., launcher='per_rank') starts the ranks one by one")
    cmd = command(target, workdir, args=args, launcher=launcher, nproc=nproc, script=script)
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(cmd, cwd=ROOT, env=scenario_env(env), start_new_session=True, **popen)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL every process of a job started by :func:`start` (its whole session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(
    target: Callable[..., Any] | str,
    workdir: str | Path,
    *,
    args: Mapping[str, Any] | None = None,
    launcher: str = "lightning",
    nproc: int = 2,
    expect_ok: bool = True,
    timeout: float = 300,
    script: str | Path | None = None,
    env: Mapping[str, str | None] | None = None,
    nnodes: int = 1,
) -> subprocess.CompletedProcess:
    """Run the scenario to its end: ``target`` is a function registered with :func:`scenario` (or its name, with
    ``script=``), started by ``launcher`` on ``nproc`` ranks with ``args`` as ``--arg key=value``.

    Raises AssertionError with the tail of stdout and stderr when it fails (with ``expect_ok``) or runs past
    ``timeout`` seconds (every rank is then killed); returns the finished process, output captured as text (with
    ``launcher="per_rank"``: a list, one per rank). ``nnodes`` > 1 (with ``launcher="torchrun"``) starts one torchrun
    per node on this machine (``--nnodes``, ``--node-rank``, a local rendezvous), as a multi-node job is started, and
    returns a list, one per node."""
    if launcher == "per_rank":
        return _run_per_rank(target, workdir, args, nproc, expect_ok, timeout, script, env)
    if nnodes > 1:
        if launcher != "torchrun":
            raise ValueError("nnodes > 1 needs launcher='torchrun' (one torchrun per node)")
        return _run_nodes(target, workdir, args, nproc, nnodes, expect_ok, timeout, script, env)
    cmd = command(target, workdir, args=args, launcher=launcher, nproc=nproc, script=script)
    proc = start(target, workdir, args=args, launcher=launcher, nproc=nproc, script=script, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"scenario {' '.join(cmd[1:])} ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}"
        ) from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if expect_ok and done.returncode != 0:
        raise AssertionError(
            f"scenario {' '.join(cmd[1:])} failed ({done.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
        )
    return done


def _run_nodes(
    target: Callable[..., Any] | str,
    workdir: str | Path,
    args: Mapping[str, Any] | None,
    nproc: int,
    nnodes: int,
    expect_ok: bool,
    timeout: float,
    script: str | Path | None,
    env: Mapping[str, str | None] | None,
) -> list[subprocess.CompletedProcess]:
    """``nnodes`` torchrun processes on this machine, each a node of ``nproc`` ranks (``--node-rank`` 0..N-1)."""
    import time

    argv = command(target, workdir, args=args, script=script)[1:]
    port = str(_free_port())
    procs, cmds = [], []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *argv,
        ]
        cmds.append(cmd)
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=scenario_env(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    done: list[subprocess.CompletedProcess] = []
    try:
        for cmd, proc in zip(cmds, procs):
            stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_job(proc)
        tails = [proc.communicate()[1][-3000:] for proc in procs[len(done) :]]
        raise AssertionError(f"scenario {' '.join(argv)} ran past {timeout} s:\n" + "\n".join(tails)) from None
    failed = [n for n, proc in enumerate(done) if proc.returncode != 0]
    if expect_ok and failed:
        tails = "\n".join(f"node {n} ({done[n].returncode}):\n{done[n].stderr[-4000:]}" for n in failed)
        raise AssertionError(f"scenario {' '.join(argv)} failed on node(s) {failed}:\n{tails}")
    return done


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_per_rank(
    target: Callable[..., Any] | str,
    workdir: str | Path,
    args: Mapping[str, Any] | None,
    nproc: int,
    expect_ok: bool,
    timeout: float,
    script: str | Path | None,
    env: Mapping[str, str | None] | None,
) -> list[subprocess.CompletedProcess]:
    import time

    cmd = command(target, workdir, args=args, script=script)
    port = str(_free_port())
    procs = []
    for r in range(nproc):
        rank_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOCAL_RANK": str(r), "NODE_RANK": "0"}
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**scenario_env(env), **rank_env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    done: list[subprocess.CompletedProcess] = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_job(proc)
        tails = [proc.communicate()[1][-3000:] for proc in procs[len(done) :]]
        raise AssertionError(f"scenario {' '.join(cmd[1:])} ran past {timeout} s:\n" + "\n".join(tails)) from None
    failed = [r for r, proc in enumerate(done) if proc.returncode != 0]
    if expect_ok and failed:
        tails = "\n".join(f"rank {r} ({done[r].returncode}):\n{done[r].stderr[-4000:]}" for r in failed)
        raise AssertionError(f"scenario {' '.join(cmd[1:])} failed on rank(s) {failed}:\n{tails}")
    return done
