"""The two test tiers (tests/helpers/tiers.py): tests that start processes are marked ``multiprocess`` on their
own, a test that starts one unmarked fails, and the inner tier (``-m "not multiprocess"``) still reaches every module
of the package."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.helpers import scenario_kit, tiers
from tests.helpers.tiers import SpawnFinder
from tests.test_layers import import_edges

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


# ----------------------------------------------------------------------------------- what the marking follows
def _plain() -> int:
    return sum(range(3))


def _runs_a_command() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _through_a_helper() -> None:
    _runs_a_command()


def _launches_a_scenario(tmp: Path) -> None:
    from tests.scenarios import dist_scenarios

    scenario_kit.run(dist_scenarios.tied, tmp)


def _imports_inside() -> None:
    from tests.helpers.scenario_kit import start as begin

    begin("x", "/w", script="s.py")


class _Launcher:
    def go(self) -> None:
        self._spawn()

    def _spawn(self) -> None:
        import os

        os.fork()


def test_the_marking_follows_calls_to_the_process_starters() -> None:
    """(The functions are named by strings: a reference in this test's own code would mark it.)"""
    finder = SpawnFinder()
    here = sys.modules[__name__]
    for name in ("_runs_a_command", "_through_a_helper", "_launches_a_scenario", "_imports_inside"):
        assert finder.spawns(getattr(here, name)), name
    assert finder.spawns(vars(here)["_Launcher"].go)
    for name in ("run", "start"):
        assert finder.spawns(getattr(scenario_kit, name)), name
    assert not finder.spawns(_plain) and not finder.spawns(scenario_kit.read_results)


def test_the_launching_tests_of_the_suite_are_marked_and_the_others_are_not(request: pytest.FixtureRequest) -> None:
    """What this session's collection marked: a test using ``tests/conftest.py``'s ``scenario`` fixture, tests that
    call the scenario kit's ``run`` in their body or through a module fixture; not a test of plain code."""
    marked = request.config.stash.get(tiers.MARKED, {})
    expected = {  # the first uses the scenario fixture
        "tests/test_distributed.py::test_seed_yaml_verbatim_trains_and_every_field_takes_effect": True,
        "tests/test_scenario_kit.py::test_argv_is_scenario_workdir_and_key_value_args": False,
        "tests/test_tiers.py::test_the_named_upstream_deprecations_pass": False,
    }
    if not set(expected) <= set(marked):
        pytest.skip("needs tests/test_distributed.py and tests/test_scenario_kit.py collected in this session")
    assert {k: marked[k] for k in expected} == expected


# ----------------------------------------------------------------------------------- the run-time check
CONFTEST = """
from tests.helpers import tiers


def pytest_configure(config):
    config.pluginmanager.register(tiers, "lightning_mm_tiers")
"""

SAMPLE = """
import subprocess
import sys
import warnings


def test_seen():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_hidden():
    getattr(subprocess, "r" + "un")([sys.executable, "-c", "pass"], check=True)


def test_in_process():
    assert sum(range(3)) == 3
"""


def _pytest(directory: Path, *args: str) -> subprocess.CompletedProcess:
    env = scenario_kit.scenario_env()
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *args, str(directory)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_unmarked_test_that_starts_a_process_fails_and_the_marked_ones_leave_the_inner_tier(
    tmp_path: Path,
) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    whole = _pytest(tmp_path)
    assert whole.returncode == 1, whole.stdout + whole.stderr
    assert "PASSED test_sample.py::test_seen" in whole.stdout
    assert "PASSED test_sample.py::test_in_process" in whole.stdout
    assert "FAILED test_sample.py::test_hidden" in whole.stdout
    assert "started a process in its call (subprocess.Popen" in whole.stdout
    assert "is not marked 'multiprocess'" in whole.stdout
    inner = _pytest(tmp_path, "-m", "not multiprocess", "--collect-only")
    assert "test_in_process" in inner.stdout and "test_hidden" in inner.stdout
    assert "test_seen" not in inner.stdout


# ----------------------------------------------------------------------------------- warnings
@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning])
def test_a_deprecation_of_torch_lightning_or_transformers_is_an_error(category: type[Warning]) -> None:
    for module in (
        "torch.nn.modules.module",
        "lightning.pytorch.trainer",
        "transformers.modeling_utils",
        "lightning_mm",
    ):
        with pytest.raises(category):
            warnings.warn_explicit("x is deprecated", category, "f.py", 1, module=module)
    with warnings.catch_warnings(record=True) as seen:  # another library's: shown, not an error
        warnings.warn_explicit("x is deprecated", category, "f.py", 1, module="torchvision_like_package")
    assert len(seen) == 1


def test_the_named_upstream_deprecations_pass() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(
            "`torch.jit.script_method` is deprecated. Please switch", DeprecationWarning, "f.py", 1, "torch.jit._script"
        )
        warnings.warn_explicit(
            "`is_gradient_checkpointing` is deprecated", FutureWarning, "f.py", 1, "transformers.modeling_utils"
        )
        warnings.warn_explicit(
            "`isinstance(treespec, LeafSpec)` is deprecated, use",
            FutureWarning,
            "f.py",
            1,
            "lightning.pytorch.utilities._pytree",
        )
    assert seen == []


# ----------------------------------------------------------------------------------- the inner tier's reach
def _imported_modules(path: Path) -> set[str]:
    """The lightning_mm and tests modules a file imports (anywhere in it); ``from pkg import Name`` counts the
    module that defines ``Name``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(("lightning_mm", "tests."))}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if not node.module.startswith(("lightning_mm", "tests")):
                continue
            found.add(node.module)
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                continue
            for alias in node.names:
                value = getattr(module, alias.name, None)
                if isinstance(value, type(sys)):
                    found.add(value.__name__)
                elif value is None:
                    found.add(f"{node.module}.{alias.name}")
                elif getattr(value, "__module__", "").startswith("lightning_mm"):
                    found.add(value.__module__)
    return found


def _named_in_strings(path: Path, modules: set[str]) -> set[str]:
    """The package modules that string constants of a file name (``class_path: lightning_mm.x.Y`` of a config)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("lightning_mm."):
            parts = node.value.split(".")
            found |= {".".join(parts[:n]) for n in range(2, len(parts) + 1)} & modules
    return found


SHIMS = {
    "lightning_mm.strategies.context_parallel",
    "lightning_mm.strategies.expert_parallel",
    "lightning_mm.modules.lora",
    "lightning_mm.modules.lora_export",
}
"""Star-import modules kept only for old import paths (issue #41 removes them): nothing of their own to test."""


def reached_modules(test_files: list[Path]) -> set[str]:
    """The package modules that ``test_files`` import (through ``tests.helpers``/``tests.scenarios`` modules too),
    and every module those import in turn, and their packages; what ``lightning_mm/__init__.py`` re-exports does
    not count."""
    package = {m for m in import_edges()}
    seen_files: set[Path] = set()
    reached: set[str] = set()
    todo = list(test_files)
    while todo:
        path = todo.pop()
        if path in seen_files or not path.is_file():
            continue
        seen_files.add(path)
        for module in _imported_modules(path) | _named_in_strings(path, package):
            if module.startswith("tests."):
                todo.append(ROOT / (module.replace(".", "/") + ".py"))
            elif module in package:
                reached.add(module)
    edges = import_edges()
    stack = list(reached)
    while stack:
        module = stack.pop()
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.is_file():
            path = ROOT / module.replace(".", "/") / "__init__.py"
        targets = set(edges.get(module, ())) | _named_in_strings(path, package)
        if module == "lightning_mm":  # the public API's re-exports are not a use; its import machinery is
            targets = {t for t in targets if t.split(".")[1].startswith("_")}
        parent = module.rpartition(".")[0]
        if parent.startswith("lightning_mm"):
            targets.add(parent)  # importing a module runs its package's __init__
        for target in targets - reached:
            reached.add(target)
            stack.append(target)
    return reached


def test_the_inner_tier_reaches_every_module_of_the_package(request: pytest.FixtureRequest) -> None:
    """Every module of ``lightning_mm`` is imported by a test module that has inner-tier tests (directly, through a
    ``tests/helpers`` module, or through the package modules those import)."""
    inner = request.config.stash.get(tiers.INNER_MODULES, {})
    every = sorted(TESTS.glob("test_*.py"))
    if not set(every) <= {Path(p) for p in inner}:
        pytest.skip("needs the whole of tests/ collected (run the inner tier: pytest -m 'not multiprocess')")
    inner_files = [p for p in every if inner.get(str(p))]
    missing = sorted(set(import_edges()) - reached_modules(inner_files) - SHIMS)
    assert missing == []
