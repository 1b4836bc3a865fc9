"""Run a callback as soon as a module is imported, without importing it (what registers ``strategy="mm_fsdp2"``).

Python has no "after import" hook, and Lightning has no entry point through which a package can add a strategy or
accelerator name (its only entry-point group, ``lightning.pytorch.callbacks_factory``, is read after the Trainer has
already resolved ``strategy=``). So ``lightning_mm/__init__.py`` uses Python's documented import machinery instead
(https://docs.python.org/3/reference/import.html#the-meta-path): :func:`call_once_imported` puts one finder at the
front of ``sys.meta_path``. It answers only for the watched modules (the target, its parents and the modules under
the given prefixes; every other import never reaches past one string comparison): it asks the finders behind it for
the real module spec and wraps that spec's loader, so that it learns when each watched module *finishes* executing.

The callback runs at the first moment the target module is in ``sys.modules`` and no watched module is half-way
through its import (in this or any other thread), which is:

* at once, inside :func:`call_once_imported`, if the target is already imported;
* otherwise right after the outermost watched import that completes the target, e.g. after ``import lightning`` has
  run to its end, or after ``import lightning_mm.strategies`` (which imports Lightning on the way) has.

Waiting for the half-imported watched modules to finish is what makes the callback safe: it may import any of them
(the registration imports ``lightning_mm.strategies``, which is exactly the module that may have started the
Lightning import). Imports the callback itself makes do not re-enter it. Once the callback has returned, the finder
takes itself out of ``sys.meta_path`` and every module it loaded keeps its own, unwrapped loader
(``module.__loader__`` and ``module.__spec__.loader``). If the callback raises, the error propagates from the import
that triggered it (a broken installation is loud, never silently skipped) and the callback is tried again after the
next watched import.

Nothing of any library is changed: no function of Lightning, torch or Python is replaced.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["call_once_imported"]


class _AfterImportFinder:
    """The meta-path finder of :func:`call_once_imported` (one per call)."""

    def __init__(self, target: str, prefixes: Sequence[str], callback: Callable[[], None]) -> None:
        parts = target.split(".")
        self._target = target
        self._exact = frozenset(".".join(parts[: i + 1]) for i in range(len(parts)))
        self._prefixes = tuple(prefixes)
        self._callback = callback
        self._lock = threading.Lock()
        self._executing = 0  # watched modules between the start and the end of their execution, all threads
        self._running_callback = False
        self.done = False

    def watches(self, name: str) -> bool:
        return name in self._exact or name.startswith(self._prefixes)

    # ------------------------------------------------------------------------------------------ finder protocol
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if self.done or not self.watches(fullname):
            return None
        finders = sys.meta_path
        after = finders[finders.index(self) + 1 :] if self in finders else finders
        for finder in after:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None  # not found: Python asks the same finders itself and reports it as usual
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _TrackingLoader(spec.loader, self)
        return spec

    # -------------------------------------------------------------------------------------------- bookkeeping
    def started(self) -> None:
        with self._lock:
            self._executing += 1

    def finished(self, ok: bool) -> None:
        with self._lock:
            self._executing -= 1
        if ok:  # a failed import is still in sys.modules here, until Python takes it out
            self.try_callback()

    def try_callback(self) -> None:
        with self._lock:
            if self.done or self._running_callback or self._executing or self._target not in sys.modules:
                return
            self._running_callback = True
        try:
            self._callback()
            self.done = True
        finally:
            self._running_callback = False
        if self.done:
            # A new list, not an in-place removal: an import running in another thread iterates the old list.
            sys.meta_path = [f for f in sys.meta_path if f is not self]


class _TrackingLoader:
    """The real loader of a watched module, reporting when the module's execution starts and ends."""

    def __init__(self, loader: Any, finder: _AfterImportFinder) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps the real loader, as if it had been imported without this finder.
        module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        self._finder.started()
        try:
            self._loader.exec_module(module)
        except BaseException:
            self._finder.finished(ok=False)
            raise
        # Python binds a submodule to its package (``pkg.sub``) only after this returns; the callback, which may run
        # in ``finished``, may already use ``import pkg.sub; pkg.sub.x``. Binding it here is the same assignment.
        parent, _, child = module.__name__.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
        self._finder.finished(ok=True)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


def call_once_imported(target: str, callback: Callable[[], None], *, also_wait_for: Sequence[str] = ()) -> None:
    """Call ``callback()`` once module ``target`` is imported and no watched import is half-way (now, if so).

    Watched: ``target`` and its parent packages, and every module whose name starts with one of ``also_wait_for``
    (e.g. ``"lightning_mm."``: modules the callback imports and that may themselves be what imports ``target``).
    Modules already imported when this is called count as complete. Does not import ``target``.
    """
    finder = _AfterImportFinder(target, also_wait_for, callback)
    sys.meta_path.insert(0, finder)
    finder.try_callback()
