"""Names that are one tensor: tied parameters (``lm_head.weight`` is ``embed_tokens.weight``) and their aliases.

A tied parameter is one ``nn.Parameter`` object registered under several names; it is found by object identity
(``id``), which holds on the meta device too, where every tensor has the same (null) data pointer. A leaf
module: it imports nothing from ``lightning_mm``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["names_by_tensor", "parameter_names_by_tensor", "tied_parameter_names"]


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
