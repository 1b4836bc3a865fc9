"""Modules and their names: dotted module paths and what contains what, tied parameter names, and the
Transformers class behind an adapted or wrapped model.

A leaf module: it imports nothing from ``lightning_mm``, and not ``transformers`` either.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "ROOT",
    "is_under",
    "is_under_any",
    "enclosing",
    "names_by_tensor",
    "parameter_names_by_tensor",
    "tied_parameter_names",
    "transformers_class",
]


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


def names_by_tensor(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, list[str]]:
    """``id(tensor)`` -> every name ``named`` gives that tensor, in order (one entry per distinct tensor object).

    ``named`` is e.g. ``module.state_dict(keep_vars=True).items()`` or
    ``module.named_parameters(remove_duplicate=False)``.
    """
    names: dict[int, list[str]] = {}
    for name, tensor in named:
        names.setdefault(id(tensor), []).append(name)
    return names


def parameter_names_by_tensor(module: nn.Module) -> dict[int, list[str]]:
    """:func:`names_by_tensor` over all of ``module``'s parameters, tied names included."""
    return names_by_tensor(module.named_parameters(remove_duplicate=False))


def tied_parameter_names(module: nn.Module) -> list[list[str]]:
    """The groups of two or more names under which ``module`` holds one parameter, in registration order."""
    return [group for group in parameter_names_by_tensor(module).values() if len(group) > 1]


def transformers_class(cls: type) -> type | None:
    """The first class in ``cls``'s MRO that is a ``PreTrainedModel`` defined in ``transformers.models``, or ``None``.

    Adapters and FSDP's wrapper classes derive from it; a model with remote code (module ``transformers_modules.*``)
    or a plain ``nn.Module`` has none: the generic bases (``PreTrainedModel``, ``GenerationMixin``) do not count.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    base = transformers.PreTrainedModel
    for klass in cls.__mro__:
        if klass.__module__.startswith("transformers.models.") and issubclass(klass, base):
            return klass
    return None
