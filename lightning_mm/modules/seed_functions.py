"""MindSpeed MM's entry functions given by value or by import path (``"pretrain_custom.forward_step"``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_mm.errors import ConfigError, DependencyError, InputTypeError

__all__ = ["SeedFunctions", "resolve_callable"]


@dataclass(frozen=True)
class SeedFunctions:
    """The MindSpeed MM functions a user passed in instead of overriding hooks (``None`` = use the hook)."""

    model_provider: Callable[..., Any] | None = None
    get_batch: Callable[..., Any] | None = None
    forward_step: Callable[..., Any] | None = None
    loss_func: Callable[..., Any] | None = None


def resolve_callable(value: Callable[..., Any] | str | None, name: str) -> Callable[..., Any] | None:
    """Return ``value`` if callable; import ``"package.module:attr"`` or ``"package.module.attr"`` strings."""
    if value is None or callable(value):
        return value
    if not isinstance(value, str) or not value.strip():
        raise InputTypeError(f"`{name}` must be a callable or an import path string, got {type(value).__name__}")
    path = value.strip()
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"`{name}`: {path!r} is not an import path like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise DependencyError(f"`{name}`: cannot import module '{module_name}' of {path!r}: {err}") from err
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise DependencyError(f"`{name}`: module '{module_name}' has no attribute '{attr}' ({path!r})")
        target = getattr(target, part)
    if not callable(target):
        raise InputTypeError(f"`{name}`: {path!r} is not callable")
    return target
