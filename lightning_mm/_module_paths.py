"""Dotted module paths (``model.layers.0.mlp``, as ``nn.Module.named_modules`` names them) and what contains what.

The root module's path is ``""`` and contains every module. A path contains itself and the paths that continue it
after a dot: ``layers.1`` contains ``layers.1.mlp`` but not ``layers.10``. A leaf module: it imports nothing from
``lightning_mm``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ROOT", "is_under", "is_under_any", "enclosing"]

ROOT = ""
"""The path of the root module."""


def is_under(path: str, ancestor: str) -> bool:
    """Whether module ``path`` is ``ancestor`` or lies inside it (always, when ``ancestor`` is the root ``""``)."""
    return ancestor == ROOT or path == ancestor or path.startswith(ancestor + ".")


def is_under_any(path: str, ancestors: Iterable[str]) -> bool:
    """Whether ``path`` is under one of ``ancestors`` (the one test of "inside an ignored module", and the like)."""
    return any(is_under(path, a) for a in ancestors)


def enclosing(path: str, ancestors: Iterable[str]) -> str | None:
    """The first of ``ancestors`` that ``path`` is under (see :func:`is_under`), or ``None``."""
    return next((a for a in ancestors if is_under(path, a)), None)
