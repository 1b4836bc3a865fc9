"""The two test tiers: every test that starts a process is marked ``multiprocess``, automatically, and checked.

``pytest -m "not multiprocess"`` is the inner loop (every test that runs in the pytest process alone);
``pytest -m multiprocess`` runs the rest (scenario launches, CLI and script runs in a subprocess).

* Marking (at collection, before ``-m`` selects): a test is ``multiprocess`` when its function, or a fixture it
  uses, can start a process: its code calls :mod:`subprocess`, ``os.fork``/``os.system``/``os.posix_spawn``/
  ``os.exec*``, :mod:`multiprocessing` or ``torch.multiprocessing``, directly or through a function of this
  checkout outside the package (``tests/``, ``examples/``, ``scripts/``, ``benchmarks/``; the scenario kit's
  ``run``/``start`` are such functions), followed call by call (names, attributes of modules and classes, imports
  inside functions, ``self.`` methods of test classes). An explicit ``@pytest.mark.multiprocess`` also marks.
* Checking (at run time): a Python audit hook (:func:`sys.addaudithook`; nothing of Lightning, torch or the
  standard library is patched) sees every process start (``subprocess.Popen``, ``os.fork``, ``os.posix_spawn``,
  ``os.system``, ``os.exec``, ``os.spawn``). A test that is not marked ``multiprocess`` and starts one, in its
  setup, call or teardown, fails and names the command: the marking missed a path, so the inner tier would not be
  what it says; mark the test explicitly. The few commands a library runs to look at the machine (:data:`PROBES`)
  are not counted.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MARK = "multiprocess"
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_mm"
SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.system", "os.exec", "os.spawn", "pty.spawn"}
)
PROBES: dict[tuple[str, ...], str] = {
    ("uname", "-p"): "platform.processor(): cached per process, so it would fail whichever test asks first",
    ("ninja", "--version"): "torch.utils.cpp_extension.is_ninja_available(), asked when Transformers builds RWKV",
}
"""Commands a library runs to look at the machine (a few milliseconds, no work of the test): not a process start of
the test's own; each with where it comes from."""
INNER_MODULES = pytest.StashKey[dict[str, bool]]()
"""Stash of a session: test module path -> whether it holds a test of the inner tier (all collected modules)."""
MARKED = pytest.StashKey[dict[str, bool]]()
"""Stash of a session: node id -> whether the test is marked ``multiprocess`` (every collected test)."""


def _primitives() -> set[int]:
    """The ids of the callables that start a process."""
    found: list[Any] = [
        subprocess.Popen,
        subprocess.run,
        subprocess.call,
        subprocess.check_call,
        subprocess.check_output,
        subprocess.getoutput,
        subprocess.getstatusoutput,
        os.system,
        os.popen,
        os.fork,
        os.forkpty,
        os.posix_spawn,
        os.posix_spawnp,
    ]
    found += [getattr(os, n) for n in dir(os) if n.startswith(("exec", "spawn")) and callable(getattr(os, n))]
    import multiprocessing

    found += [multiprocessing.Process, multiprocessing.Pool, multiprocessing.get_context]
    for name in ("torch.multiprocessing", "asyncio"):
        module = sys.modules.get(name)
        for attr in ("spawn", "start_processes", "create_subprocess_exec", "create_subprocess_shell"):
            if module is not None and hasattr(module, attr):
                found.append(getattr(module, attr))
    return {id(f) for f in found}


def _under(obj: Any, root: Path) -> bool:
    try:
        path = Path(inspect.getsourcefile(obj) or "").resolve()
    except (TypeError, OSError):
        return False
    return path.is_relative_to(root) and ".venv" not in path.parts and "site-packages" not in path.parts


def _in_checkout(obj: Any) -> bool:
    """A function or class of this checkout outside the package (whose code we follow)."""
    return _under(obj, ROOT) and not _under(obj, PACKAGE)


class SpawnFinder:
    """Whether a function can start a process (see the module docstring), cached per function."""

    def __init__(self) -> None:
        self._primitives = _primitives()
        self._seen: dict[int, bool] = {}

    def spawns(self, obj: Any, root: Path = ROOT) -> bool:
        """Whether ``obj`` can start a process; its own code is read where it lies under ``root`` (a test function
        is read wherever it lies), the code it calls where that lies in this checkout outside the package."""
        if root != ROOT and inspect.isfunction(obj) and _under(obj, root):
            return self._function_spawns(obj)
        func = inspect.unwrap(obj) if callable(obj) else obj
        if isinstance(func, (staticmethod, classmethod)):
            func = func.__func__
        if isinstance(func, types.MethodType):
            func = func.__func__
        key = id(func)
        if key in self._seen:
            return self._seen[key]
        if key in self._primitives:
            return True
        self._seen[key] = False  # recursion guard
        result = False
        if inspect.isclass(func) and _in_checkout(func):
            result = any(self.spawns(m) for m in vars(func).values() if inspect.isfunction(m))
        elif inspect.isfunction(func) and _in_checkout(func):
            result = self._function_spawns(func)
        self._seen[key] = result
        return result

    def _function_spawns(self, func: types.FunctionType) -> bool:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError, SyntaxError):
            return False
        scope: dict[str, Any] = dict(func.__globals__)
        for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
            try:
                scope[name] = cell.cell_contents
            except ValueError:
                pass
        owner = self._owner(func)
        if owner is not None:
            scope.setdefault("self", owner)
            scope.setdefault("cls", owner)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                scope.update(self._imported(node, func))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Name, ast.Attribute)):
                target = self._resolve(node, scope)
                if target is not None and (callable(target) or inspect.isclass(target)) and self.spawns(target):
                    return True
        return False

    @staticmethod
    def _owner(func: types.FunctionType) -> type | None:
        qualname = func.__qualname__.split(".")
        if len(qualname) < 2 or "<locals>" in qualname:
            return None
        owner: Any = sys.modules.get(func.__module__)
        for part in qualname[:-1]:
            owner = getattr(owner, part, None)
        return owner if inspect.isclass(owner) else None

    @staticmethod
    def _imported(node: ast.Import | ast.ImportFrom, func: types.FunctionType) -> dict[str, Any]:
        names: dict[str, Any] = {}
        try:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module = importlib.import_module(alias.name)
                    names[alias.asname or alias.name.split(".")[0]] = (
                        module if alias.asname else importlib.import_module(alias.name.split(".")[0])
                    )
            else:
                base = node.module or ""
                if node.level:
                    package = func.__module__.rsplit(".", node.level)[0]
                    base = f"{package}.{base}" if base else package
                module = importlib.import_module(base)
                for alias in node.names:
                    value = getattr(module, alias.name, None)
                    if value is None:
                        value = importlib.import_module(f"{base}.{alias.name}")
                    names[alias.asname or alias.name] = value
        except Exception:  # an import that fails here fails in the test itself, with its own message
            pass
        return names

    @staticmethod
    def _resolve(node: ast.expr, scope: dict[str, Any]) -> Any:
        if isinstance(node, ast.Name):
            return scope.get(node.id)
        if isinstance(node, ast.Attribute):
            base = SpawnFinder._resolve(node.value, scope)
            if isinstance(base, types.ModuleType) or inspect.isclass(base):
                try:
                    return inspect.getattr_static(base, node.attr)
                except AttributeError:
                    return None
        return None


def item_spawns(item: pytest.Item, finder: SpawnFinder) -> bool:
    """Whether the test function of ``item`` or a fixture it uses can start a process."""
    if not isinstance(item, pytest.Function):
        return False
    function = inspect.unwrap(item.function)
    if finder.spawns(function, root=Path(inspect.getsourcefile(function) or ".").resolve().parent):
        return True
    root = item.config.rootpath.resolve()
    info = getattr(item, "_fixtureinfo", None)
    fixtures = [d.func for defs in (info.name2fixturedefs.values() if info is not None else ()) for d in defs]
    return any(finder.spawns(f, root=root) for f in fixtures)


# ------------------------------------------------------------------------------------------------- pytest hooks
_STATE: dict[str, Any] = {"item": None, "events": [], "installed": False}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in SPAWN_EVENTS and _STATE["item"] is not None:
        what = args[1] if event == "subprocess.Popen" and len(args) > 1 else args
        if isinstance(what, (list, tuple)) and tuple(str(a) for a in what) in PROBES:
            return
        _STATE["events"].append(f"{event} {what!r}"[:300])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARK}: starts processes (scenario launches, subprocess runs); marked automatically"
    )
    if not _STATE["installed"]:
        sys.addaudithook(_audit)
        _STATE["installed"] = True


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    finder = SpawnFinder()
    inner: dict[str, bool] = {}
    marked: dict[str, bool] = {}
    for item in items:
        if item.get_closest_marker(MARK) is None and item_spawns(item, finder):
            item.add_marker(MARK)
        marked[item.nodeid] = item.get_closest_marker(MARK) is not None
        path = str(item.path)
        inner[path] = inner.get(path, False) or not marked[item.nodeid]
    config.stash[INNER_MODULES], config.stash[MARKED] = inner, marked


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _watch(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _watch(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _watch(item, "teardown"))


def _watch(item: pytest.Item, phase: str) -> Iterator[None]:
    _STATE["item"], _STATE["events"] = item, []
    try:
        result = yield
    finally:
        events, _STATE["item"], _STATE["events"] = _STATE["events"], None, []
    if events and item.get_closest_marker(MARK) is None:
        pytest.fail(
            f"{item.nodeid} started a process in its {phase} ({events[0]}) but is not marked {MARK!r}: the automatic "
            f"marking (tests/helpers/tiers.py) did not see that path; mark the test @pytest.mark.{MARK}",
            pytrace=False,
        )
    return result
