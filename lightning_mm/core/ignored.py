"""The one owner of ``ignored_modules``: modules kept whole on every rank, outside FSDP.

FSDP2 leaves an ignored parameter alone entirely: it is not sharded, not cast, not moved to the device, and its
gradient is not reduced (pytorch #148242). Everything that has to happen to the plan's ignored modules instead
is here, and every other place asks :class:`IgnoredModules` rather than working it out again:

* their parameters, which ``fully_shard`` gets as ``ignored_params`` (:meth:`IgnoredModules.parameters`);
* their inputs, cast to their own dtype when FSDP casts the batch (:meth:`IgnoredModules.cast_inputs`);
* their placement on the compute device after meta-device materialisation (:meth:`IgnoredModules.place`);
* the averaging of their trainable parameters' gradients over the ranks (:meth:`IgnoredModules.all_reduce_gradients`).

Which paths are ignored (and so whole on every rank, in the memory estimate too) is the plan's data:
``plan.ignored_modules`` and :meth:`~lightning_mm.core.sharding_plan.ShardingPlan.is_ignored`. Rank 0's initial
values reach the other ranks with every other plain tensor that was materialised
(:func:`~lightning_mm.core.apply.broadcast_replicated`). Lightning-free.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mm._utils.distributed import average_in_place
from lightning_mm.core.module_state import add_input_hook
from lightning_mm.core.sharding_plan import ShardingPlan

__all__ = ["IgnoredModules"]


class IgnoredModules:
    """The plan's ``ignored_modules`` on ``target`` (the module the plan's paths are relative to).

    Parameters are looked up when asked for, not kept: materialisation may replace parameter objects.
    """

    def __init__(self, target: nn.Module, plan: ShardingPlan) -> None:
        self.paths = plan.ignored_modules
        self.modules = [target.get_submodule(path) for path in plan.ignored_modules]
        self._cast = plan.precision.cast_forward_inputs and plan.precision.param_dtype is not None

    def __bool__(self) -> bool:
        return bool(self.modules)

    def parameters(self) -> set[nn.Parameter]:
        """Every parameter of the ignored modules (``fully_shard``'s ``ignored_params``): never sharded."""
        return {p for module in self.modules for p in module.parameters()}

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients :meth:`all_reduce_gradients` averages."""
        return [p for module in self.modules for p in module.parameters() if p.requires_grad]

    def cast_inputs(self) -> None:
        """Ignored modules get no mixed-precision policy and compute in their own parameter dtype.

        FSDP casts each unit's floating inputs to ``param_dtype``; an ignored module's inputs are cast to its own
        parameter dtype instead, so that it keeps working when the root casts the batch.
        """
        if self._cast:
            for module in self.modules:
                add_input_hook(module, _cast_inputs_to_own_dtype, "ignored_modules: inputs cast to its own dtype")

    def place(self, device: torch.device) -> None:
        """Move the ignored modules to the compute device (FSDP moves only what it shards)."""
        for module in self.modules:
            module.to(device)

    def all_reduce_gradients(self, group: Any = None) -> None:
        """Average the trainable ignored parameters' gradients across the data-parallel ranks (after backward)."""
        average_in_place([p.grad for p in self.trainable_parameters() if p.grad is not None], group)


def _cast_inputs_to_own_dtype(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return args, kwargs

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
