"""Taking the state a checkpoint stores: the model's and the optimisers' state dicts (this rank's shards, or gathered
whole on rank 0, optionally seen through a :data:`StateView`), the optimisers' parameter names, the tied-weight
groups, and a copy of Lightning's dict whose loop state may be modified."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from lightning_mm._compat import unwrap_optimizer
from lightning_mm._utils.distributed import is_rank_zero
from lightning_mm._utils.modules import tied_parameter_names
from lightning_mm.checkpoint.optim_keys import group_param_names, to_index_keyed

__all__ = [
    "StateView",
    "model_state",
    "optimizer_state",
    "OPTIMIZER_NAMES_KEY",
    "optimizer_param_names",
    "gather_full",
    "alias_groups",
    "copy_loops",
]


StateView = Callable[[dict[str, Any]], dict[str, Any]]
"""Maps a sharded state dict to the one a checkpoint stores: the same keys, some tensors replaced by views of them
with another (global) layout, sharing their storage (expert parallelism's local experts as shares of all experts)."""


def model_state(model: nn.Module, full: bool, view: StateView | None = None) -> dict[str, Any]:
    """The model state: this rank's shards, or (``full``) the gathered tensors on rank 0 and nothing elsewhere.

    With ``view``, the shards are seen through it first (and then gathered when ``full``).
    """
    if view is None:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    state = view(get_model_state_dict(model, options=StateDictOptions()))
    return gather_full(state) if full else state


def optimizer_state(model: nn.Module, optimizer: Any, full: bool, view: StateView | None = None) -> dict[str, Any]:
    """The optimiser state: this rank's shards keyed by parameter name, or (``full``) the gathered state on rank 0
    in torch's standard layout (keyed by parameter index, names kept alongside in ``param_groups``), which
    ``torch.optim.Optimizer.load_state_dict`` and other Lightning strategies load.

    With ``view``, the shards are seen through it first (and then gathered when ``full``).
    """
    if view is None:
        state = get_optimizer_state_dict(
            model, unwrap_optimizer(optimizer), options=StateDictOptions(full_state_dict=full, cpu_offload=full)
        )
    else:
        state = view(get_optimizer_state_dict(model, unwrap_optimizer(optimizer), options=StateDictOptions()))
        state = gather_full(state) if full else state
    return to_index_keyed(state) if full else state


OPTIMIZER_NAMES_KEY = "optimizer_param_names"
"""The ``lightning_mm`` entry of a ``torch`` checkpoint: each optimiser's parameter names per group, what the
indices of its (torch-layout) state stand for."""


def optimizer_param_names(model: nn.Module, optimizers: Sequence[Any]) -> list[list[list[str]]]:
    """For each optimiser, its parameter names (FQNs) per group, as :func:`optimizer_state` names them (local:
    no collective)."""
    return [
        group_param_names(get_optimizer_state_dict(model, unwrap_optimizer(o), options=StateDictOptions()))
        for o in optimizers
    ]


def gather_full(state: dict[str, Any]) -> dict[str, Any]:
    """Every DTensor of a (nested) state dict gathered whole, on rank 0's CPU; an empty dict on the other ranks.

    What ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` gives, for a state seen through a view. Every
    rank calls this with the same keys in the same order (one collective per DTensor).
    """
    rank0 = is_rank_zero()

    def gather(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: gather(v) for k, v in value.items()}
        if isinstance(value, list):
            return [gather(v) for v in value]
        if isinstance(value, DTensor):
            if value.device.type != value.device_mesh.device_type:  # offloaded shards: gathered on the mesh device
                value = value.to(value.device_mesh.device_type)
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            return value.detach().cpu() if rank0 else None
        return copy.deepcopy(value)

    gathered = gather(state)
    return gathered if rank0 else {}


def alias_groups(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one parameter (tied weights)."""
    return tied_parameter_names(model)


def copy_loops(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of the dict in which the loop state may be modified (per-rank entries are taken out of it)."""
    checkpoint = dict(checkpoint)
    if "loops" in checkpoint:
        checkpoint["loops"] = copy.deepcopy(checkpoint["loops"])
    return checkpoint
