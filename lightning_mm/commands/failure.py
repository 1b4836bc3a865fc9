"""Which exception of a failed command is the user's to fix, and how the command prints it.

An error is "ours" (printed as one line, no traceback) when it is a :class:`lightning_mm.errors.LightningMMError`:
the type decides, not the module that raised it. Such an error may be wrapped: its causes and contexts are searched,
and so are the exceptions that jsonargparse collects while it tries the members of a ``Union`` type (a strategy given
by class path fails that way: the message of the error from our ``__init__`` ends up as one line among many in
jsonargparse's). Anything else is a bug and keeps its traceback.

Imports nothing heavy: it runs before Lightning is imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from lightning_mm.errors import LightningMMError

__all__ = ["TRACEBACK_ENV", "user_error", "one_line", "traceback_requested"]

TRACEBACK_ENV = "LIGHTNING_MM_TRACEBACK"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_WRAPPERS = ("jsonargparse",)  # libraries that keep the exceptions they swallow in local variables
_MAX_SEARCHED = 200


def traceback_requested() -> bool:
    """True when ``LIGHTNING_MM_TRACEBACK`` is set to anything but ``""`` or ``0``."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def _is_ours(error: BaseException) -> bool:
    return isinstance(error, LightningMMError)


def _swallowed(error: BaseException) -> Iterator[BaseException]:
    """Exceptions held in the local variables of a wrapping library's frames on ``error``'s traceback."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if str(frame.f_globals.get("__name__", "")).split(".")[0] in _WRAPPERS:
            for value in list(frame.f_locals.values()):
                if isinstance(value, BaseException):
                    yield value
                elif isinstance(value, (list, tuple)):
                    yield from (item for item in value if isinstance(item, BaseException))
        tb = tb.tb_next


def user_error(error: BaseException) -> BaseException | None:
    """The outermost exception in ``error``'s chain that is ours to report, or ``None`` (a bug: show it all)."""
    queue, seen = [error], set[int]()
    while queue and len(seen) < _MAX_SEARCHED:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if _is_ours(current):
            return current
        queue += [e for e in (current.__cause__, current.__context__) if e is not None]
        queue += list(_swallowed(current))
    return None


def one_line(error: BaseException) -> str:
    """The message of ``error`` without the quotes ``KeyError`` adds; its class name when it has none."""
    if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
        text = error.args[0]
    else:
        text = str(error)
    return text.strip() or type(error).__name__
