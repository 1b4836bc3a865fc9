"""The one place that writes onto a user's module: each write a named function saying what, why and how to see it.

Applying a plan changes a few things on the modules of the user's model that a reader of the user's class cannot
see in its source. FSDP2 and MindSpeed MM's conventions need them; nothing else in ``lightning_mm.core``,
``.hf``, ``.modules`` or ``.diffusers`` sets an attribute on a module it did not create (tests/test_module_state.py
scans the sources for it). Every write is recorded, and :func:`describe_module_changes` lists them for a model
(what the strategy can log after sharding):

* :func:`replace_forward`: the instance attribute ``forward`` (shadowing the class's method), for
  ``compile_modules`` (:mod:`~lightning_mm.core.compile`), ``recompute_modules``
  (:mod:`~lightning_mm.core.recompute`) and expert parallelism's token routing
  (:mod:`~lightning_mm.core.expert_parallel`). Module names and parameters stay as they are (a wrapper module
  would rename every parameter and break checkpoints and the plan's paths); ``del module.forward`` undoes it.
* :func:`set_fsdp2_config`: ``module.fsdp2_config``, MindSpeed MM's convention: a model's own
  ``_fully_shard(fsdp2_kwargs, fsdp2_config)`` may read ``self.fsdp2_config``.
* :func:`keep_local_experts`: a MoE module's parameters replaced by this rank's rows of the experts dimension, and
  its ``num_experts`` (when it has one: Transformers' expert loop reads it) set to the local count. The global
  index of its first local expert is kept here, not on the module (:func:`expert_row_offset`).
* :func:`add_input_hook`: a forward pre-hook kept for the run (the ignored modules' input cast); the hooks that
  only watch the first forward (prefetch order) remove themselves and are not listed.
* :func:`move_buffer`: an existing buffer replaced by its copy on the compute device (FSDP2 moves only what it
  shards), its name and persistence unchanged.

Lightning-free.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_mm._utils.suggestions import listing

__all__ = [
    "ModuleChange",
    "replace_forward",
    "set_fsdp2_config",
    "keep_local_experts",
    "expert_row_offset",
    "add_input_hook",
    "move_buffer",
    "module_changes",
    "describe_module_changes",
]


@dataclass(frozen=True)
class ModuleChange:
    """One write onto a module: the attribute written and why."""

    attribute: str
    """The attribute (``forward``, ``fsdp2_config``, ``num_experts``, a parameter's name)."""
    reason: str
    """What needed it (``recompute_modules``, ``compile_modules``, expert parallelism, MindSpeed MM)."""


_CHANGES: weakref.WeakKeyDictionary[nn.Module, dict[str, ModuleChange]] = weakref.WeakKeyDictionary()
# The record of every write (the module's own dict is not touched by the record); weak: it dies with the model.
_EXPERT_OFFSETS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _record(module: nn.Module, attribute: str, reason: str) -> None:
    changes = _CHANGES.setdefault(module, {})
    previous = changes.get(attribute)
    if previous is not None and reason not in previous.reason.split(" + "):
        reason = f"{previous.reason} + {reason}"  # recomputation wraps a compiled forward
    changes[attribute] = ModuleChange(attribute, reason)


def replace_forward(module: nn.Module, forward: Callable[..., Any], reason: str) -> None:
    """Set ``module.forward`` (an instance attribute over the class's ``forward``) to ``forward``, which wraps the
    previous one, for ``reason`` (``compile_modules``, ``recompute_modules``, expert parallelism).

    ``nn.Module.__call__`` runs it with the module's hooks (FSDP2's included) around it, so the module keeps its
    name, its parameters and its place in the tree; ``del module.forward`` gives back the class's method.
    """
    module.forward = forward
    _record(module, "forward", reason)


def set_fsdp2_config(module: nn.Module, config: Any) -> None:
    """Set ``module.fsdp2_config`` to the config being applied, before its own ``_fully_shard`` is called.

    MindSpeed MM's convention: a model's ``_fully_shard(fsdp2_kwargs, fsdp2_config)`` may read it from
    ``self.fsdp2_config`` (``FSDP2Mixin`` declares the attribute).
    """
    module.fsdp2_config = config
    _record(module, "fsdp2_config", "a model's own _fully_shard (MindSpeed MM reads self.fsdp2_config)")


def keep_local_experts(module: nn.Module, local: dict[str, nn.Parameter], first: int, count: int) -> None:
    """Expert parallelism: replace ``module``'s parameters by ``local`` (name -> this rank's ``count`` experts, from
    global expert ``first``), and set its integer ``num_experts``, if it has one, to ``count``.

    The module's own forward then runs its local experts only (Transformers' expert loop reads ``num_experts``);
    loading and saving ask :func:`expert_row_offset` for ``first``.
    """
    for name, param in local.items():
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        owner.register_parameter(leaf, param)  # an existing parameter's name: replaced in place
    shown = ", ".join(local)
    _record(module, "parameters", f"expert parallelism: experts {first}..{first + count - 1} of {shown}")
    declared = getattr(module, "num_experts", None)
    if isinstance(declared, int) and not isinstance(declared, bool):
        # nn.Module.__setattr__'s annotation takes tensors and modules; any other value is a plain attribute
        module.num_experts = count  # type: ignore[assignment]
        _record(module, "num_experts", f"expert parallelism: {count} local experts of {declared}")
    _EXPERT_OFFSETS[module] = first


def expert_row_offset(module: nn.Module) -> int:
    """The global index of ``module``'s first local expert (0 for a module that :func:`keep_local_experts` did not
    split)."""
    return _EXPERT_OFFSETS.get(module, 0)


def add_input_hook(module: nn.Module, hook: Callable[..., Any], reason: str) -> None:
    """Register ``hook`` as a forward pre-hook of ``module`` (``with_kwargs=True``) for the rest of the run, for
    ``reason``; listed as ``forward pre-hook``."""
    module.register_forward_pre_hook(hook, with_kwargs=True)
    _record(module, "forward pre-hook", reason)


def move_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace ``module``'s existing buffer ``name`` by ``tensor`` (its copy on the compute device: FSDP2 moves only
    the parameters it shards). It stays a buffer of the same name and persistence; not recorded (as ``module.to``)."""
    if name not in dict(module.named_buffers(recurse=False)):
        raise KeyError(f"{type(module).__name__} has no buffer {name!r}")
    setattr(module, name, tensor)  # nn.Module.__setattr__ keeps an existing buffer a buffer


def module_changes(model: nn.Module) -> dict[str, tuple[ModuleChange, ...]]:
    """Module path (``""``: ``model`` itself) -> the writes this module made onto it, in module order."""
    out = {}
    for path, module in model.named_modules():
        changes = _CHANGES.get(module)
        if changes:
            out[path] = tuple(changes.values())
    return out


def describe_module_changes(model: nn.Module) -> str:
    """A readable listing of :func:`module_changes`, one line per attribute and reason with the modules it was set
    on (empty when nothing was written)."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for path, changes in module_changes(model).items():
        for change in changes:
            grouped.setdefault((change.attribute, change.reason), []).append(path or "<model>")
    if not grouped:
        return ""
    lines = [f"  {attribute} ({reason}): {listing(paths, 6)}" for (attribute, reason), paths in grouped.items()]
    return "\n".join(["attributes set on the model's modules (lightning_mm.core.module_state):", *lines])
