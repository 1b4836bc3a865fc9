"""The one protocol of the multi-rank scenario scripts and the one launcher (tests/helpers/scenario_kit.py): every
script follows it, no test starts a scenario any other way, and the kit's own argv parsing and command lines (no process
is started here)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.helpers import scenario_kit
from tests.helpers.scenario_kit import ROOT, command, parse_argv, scenario

TESTS = ROOT / "tests"
SCENARIOS = TESTS / "scenarios"
SCRIPTS = sorted(SCENARIOS.glob("*_scenarios.py"))
HELPERS = {"ep_custom_scenarios.py"}  # scenario code imported by another script, without a command line of its own


def _main_block(tree: ast.Module) -> list[ast.stmt] | None:
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            return node.body
    return None


def _script_problems(path: Path) -> list[str]:
    source = path.read_text()
    tree = ast.parse(source)
    block = _main_block(tree)
    if path.name in HELPERS:
        return [] if block is None else [f"{path.name} has a command line of its own: register @scenario functions"]
    problems = []
    if block is None or [ast.unparse(s) for s in block] != ["scenario_kit.main()"]:
        problems.append(f"{path.name}: its __main__ block is not exactly scenario_kit.main()")
    decorated = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d).split("(")[0] == "scenario" for d in node.decorator_list)
    ]
    if not decorated:
        problems.append(f"{path.name} registers no @scenario")
    for name in ("sys.argv", "mp.spawn", "multiprocessing", "globals()["):
        if name in source:
            problems.append(f"{path.name} uses {name}: the kit parses the command line and starts the ranks")
    return problems


def test_every_scenario_script_dispatches_through_the_kit_and_reads_no_argv_itself() -> None:
    assert len(SCRIPTS) > 20
    assert [problem for path in SCRIPTS for problem in _script_problems(path)] == []


def _launch_problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    problems = []
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        name = ast.unparse(call.func)
        if name in ("mp.spawn", "torch.multiprocessing.spawn"):
            problems.append(f"{path.name}:{call.lineno} calls {name}")
        if name.startswith("subprocess.") or name in ("Popen", "check_output"):
            text = ast.unparse(call)
            for needle in ("_scenarios.py", "_scenarios'", "torch.distributed.run", "torchrun"):
                if needle in text:
                    problems.append(f"{path.name}:{call.lineno} starts a scenario without the launcher: {text}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith("_scenarios.py"):
            problems.append(f"{path.name}:{node.lineno} names a scenario script by path: pass the function")
    return problems


def test_no_test_starts_a_scenario_script_except_through_the_launcher() -> None:
    """A subprocess started by a test file never names a ``*_scenarios.py`` script, ``torch.distributed.run`` or
    ``mp.spawn``: multi-rank jobs go through ``scenario_kit.run``/``start``."""
    files = [p for p in sorted(TESTS.glob("test_*.py")) if p.name != Path(__file__).name]
    assert [problem for path in files for problem in _launch_problems(path)] == []


def test_argv_is_scenario_workdir_and_key_value_args() -> None:
    assert parse_argv(["main", "/w"]) == ("main", Path("/w"), {})
    assert parse_argv(["two", "w", "--arg", "ckptdir=/c=d", "--arg", "n=3"]) == (
        "two",
        Path("w"),
        {"ckptdir": "/c=d", "n": "3"},
    )
    for bad in ([], ["main"], ["--arg", "a=b"], ["main", "w", "--arg"], ["main", "w", "x=1"], ["m", "w", "--arg", "x"]):
        with pytest.raises(SystemExit, match="usage: SCENARIO WORKDIR"):
            parse_argv(bad)
    with pytest.raises(SystemExit, match="repeated key 'a'"):
        parse_argv(["m", "w", "--arg", "a=1", "--arg", "a=2"])


def test_command_lines_of_the_launchers() -> None:
    from tests.scenarios import ckpt_scenarios, clip_scenarios

    script = str(SCENARIOS / "ckpt_scenarios.py")
    assert command(ckpt_scenarios.crash, "/w") == [sys.executable, script, "crash", "/w"]
    assert command(ckpt_scenarios.crash, "/w", args={"a": 1, "b": Path("/x")}) == [
        *[sys.executable, script, "crash", "/w"],
        *["--arg", "a=1", "--arg", "b=/x"],
    ]
    assert command(clip_scenarios.clip, "/w", launcher="torchrun", nproc=4) == [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"],
        *[str(SCENARIOS / "clip_scenarios.py"), "clip", "/w"],
    ]
    assert command("main", "/w", script="/s.py") == [sys.executable, "/s.py", "main", "/w"]
    with pytest.raises(ValueError, match="launcher 'mpirun'"):
        command(ckpt_scenarios.crash, "/w", launcher="mpirun")
    with pytest.raises(TypeError, match="needs script="):
        command("main", "/w")
    with pytest.raises(TypeError, match="not registered with @scenario"):
        command(ckpt_scenarios.fit, "/w")


def test_registration_is_per_module_and_by_name() -> None:
    def act(work: Path) -> None:
        pass

    registered = scenario(exit_cleanly=False)(act)
    assert registered is act and act.scenario_name == "act" and not act.scenario_exit_cleanly
    assert scenario_kit.scenarios(__name__)["act"] is act
    with pytest.raises(ValueError, match="registered twice"):
        scenario(act)
    scenario_kit._REGISTRY[__name__].pop("act")


def test_the_environment_has_the_checkout_one_thread_and_no_local_rank(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("EP_ONLY", "x")
    env = scenario_kit.scenario_env({"EP_ONLY": None, "EXTRA": "1"})
    assert env["PYTHONPATH"] == str(ROOT) and env["OMP_NUM_THREADS"] == "1" and env["EXTRA"] == "1"
    assert "LOCAL_RANK" not in env and "EP_ONLY" not in env
