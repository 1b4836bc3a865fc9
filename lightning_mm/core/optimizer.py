"""The optimiser step's implementation for FSDP2 parameters: torch's fused Adam/AdamW where torch leaves it open.

FSDP2 hands the optimiser DTensor parameters. When a group sets neither ``fused`` nor ``foreach``, torch picks
the implementation itself and, on the CPU, picks a Python loop over parameters, so every elementwise operation of
every parameter goes through DTensor's dispatch. torch's fused Adam/AdamW kernel computes the same update in one
call per group (benchmarks/README.md, "Tuning": 4-6x faster steps at every size measured). Groups that choose an
implementation themselves are left alone, and so is anything the fused kernel cannot take: other optimisers, and
groups whose trainable parameters mix DTensors with plain tensors (a trainable ignored module), which one fused
call cannot hold. Frozen parameters do not count: the step skips them. (A group whose frozen plain parameters are
unfrozen later in the run then fails in its step with DTensor's "mixed torch.Tensor and DTensor" error; pass
``fused=False`` to such an optimiser, or ``fused_optimizer_step=False`` to the strategy.)

The choice never shows in the user's parameter groups: :class:`FusedSteps` sets ``fused=True`` only while a step
computes its update (after the forward and backward) and gives the group its own value back when the step ends,
so ``optimizer.state_dict()``, the strategy's ``optimizer_state`` and every checkpoint hold the values the user
gave (a checkpoint restored under another strategy, or this one, gives back the saved groups key for key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

#: Device types whose fused Adam/AdamW kernels this project has run (NPU is left to torch_npu's own defaults).
FUSED_DEVICE_TYPES = ("cpu", "cuda")

#: Param-group keys that choose how a step is computed, not what it computes: a resumed run keeps its own.
IMPLEMENTATION_KEYS = ("fused", "foreach")


@dataclass(frozen=True)
class GroupDecision:
    """Whether one parameter group is switched to the fused step, and if not, why."""

    optimizer: int
    group: int
    fused: bool
    reason: str

    def describe(self) -> str:
        verdict = "fused step" if self.fused else f"unchanged ({self.reason})"
        return f"optimizer {self.optimizer} group {self.group}: {verdict}"


def _why_not_fused(optimizer: torch.optim.Optimizer, group: dict) -> str:
    """The reason a group keeps torch's choice, or ``""`` when the fused step can take it."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return f"{type(optimizer).__name__} is not Adam/AdamW"
    if group.get("fused") is not None or group.get("foreach") is not None:
        return "the group chooses its implementation (fused/foreach set)"
    if group.get("differentiable") or group.get("capturable"):
        return "differentiable/capturable"
    params = [p for p in group["params"] if p.requires_grad]  # the step skips parameters without gradients
    if not params:
        return "no trainable parameters"
    if any(optimizer.state.get(p) for p in params):
        return "the optimiser has already stepped"
    if any(not torch.is_floating_point(p) or p.device.type not in FUSED_DEVICE_TYPES for p in params):
        return f"parameters not all floating point on {'/'.join(FUSED_DEVICE_TYPES)}"
    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) > 1:
        return (
            "the group mixes sharded (DTensor) and unsharded (e.g. ignored-module) trainable parameters; "
            "`group_by_sharding` puts them in separate groups, which can then both take the fused step"
        )
    return ""


def group_by_sharding(params: Iterable[torch.nn.Parameter]) -> list[dict[str, list[torch.nn.Parameter]]]:
    """Parameter groups for an optimiser: sharded (DTensor) parameters, then unsharded ones (e.g. ignored modules).

    One group when all parameters are of one kind. Groups of one kind each can take the fused step.
    """
    params = list(params)
    sharded: list[torch.nn.Parameter] = [p for p in params if isinstance(p, DTensor)]
    unsharded = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (sharded, unsharded) if group]


def decide_fused_steps(optimizers: Iterable[torch.optim.Optimizer]) -> list[GroupDecision]:
    """For every parameter group, whether it can take torch's fused Adam/AdamW step (nothing is changed)."""
    decisions = []
    for i, optimizer in enumerate(optimizers):
        for j, group in enumerate(optimizer.param_groups):
            reason = _why_not_fused(optimizer, group)
            decisions.append(GroupDecision(i, j, not reason, reason))
    return decisions


class FusedSteps:
    """Torch's fused Adam/AdamW step for the groups :func:`decide_fused_steps` allows, without writing into them.

    :meth:`choose` decides once (before the first step); :meth:`step` wraps one optimizer step's closure so that,
    once the closure has run (forward and backward), the chosen groups that still leave ``fused``/``foreach``
    unset read ``fused=True`` for the update, and get their own value back when the step ends, also when it
    raises. Groups are found by index at each step (a checkpoint load replaces the group dicts).
    """

    def __init__(self) -> None:
        self._chosen: list[tuple[torch.optim.Optimizer, tuple[int, ...]]] = []

    def choose(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[GroupDecision]:
        """Decide for every group of ``optimizers`` (nothing is written into them); returns every decision."""
        decisions = decide_fused_steps(optimizers)
        self._chosen = []
        for i, optimizer in enumerate(optimizers):
            groups = tuple(d.group for d in decisions if d.optimizer == i and d.fused)
            if groups:
                self._chosen.append((optimizer, groups))
        return decisions

    def groups(self, optimizer: Any) -> tuple[int, ...]:
        """The indices of ``optimizer``'s groups that take the fused step (empty: none, or not chosen here)."""
        return next((groups for o, groups in self._chosen if o is optimizer), ())

    @contextmanager
    def step(self, optimizer: Any, closure: Callable[[], Any]) -> Iterator[Callable[[], Any]]:
        """Yield ``closure`` wrapped for one step of ``optimizer`` (see the class docstring)."""
        chosen = self.groups(optimizer)
        if not chosen:
            yield closure
            return
        switched: list[tuple[dict[str, Any], bool, Any]] = []

        def then_fused() -> Any:
            result = closure()
            for j in chosen:
                if j >= len(optimizer.param_groups):
                    continue
                group = optimizer.param_groups[j]
                if group.get("fused") is None and group.get("foreach") is None:
                    switched.append((group, "fused" in group, group.get("fused")))
                    group["fused"] = True
                    _fused_step_counts(optimizer, group)
            return result

        try:
            yield then_fused
        finally:
            for group, had, value in switched:
                if had:
                    group["fused"] = value
                else:
                    del group["fused"]


def _fused_step_counts(optimizer: Any, group: dict[str, Any]) -> None:
    """The fused kernel takes each parameter's ``step`` count as float32 on the parameter's device (as torch's
    ``load_state_dict`` puts it for a fused group); a count restored or created for another implementation (a
    CPU scalar beside accelerator parameters) is moved there once."""
    for param in group["params"]:
        state = optimizer.state.get(param)
        step = state.get("step") if state else None
        if isinstance(step, torch.Tensor) and (step.device != param.device or step.dtype != torch.float32):
            state["step"] = step.to(dtype=torch.float32, device=param.device)
