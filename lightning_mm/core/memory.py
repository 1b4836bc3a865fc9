"""Per-rank memory of a sharding plan, computed from the (meta) model alone: parameters, gradients, optimiser.

FSDP2 shards every managed parameter on dim 0 in ``ceil(dim0 / shard_size)`` row chunks; the first ranks hold
full chunks, so the figures below are the maximum over ranks. Ignored parameters are whole on every rank.
Gradients exist for trainable parameters, in the parameters' storage dtype; the optimiser holds
``optimizer_states`` tensors per trainable parameter (2 for Adam/AdamW) of the same size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from lightning_mm.core.sharding_plan import ShardingPlan

__all__ = ["RankMemory", "per_rank_memory", "local_numel"]


@dataclass(frozen=True)
class RankMemory:
    """Bytes held by the most loaded rank, next to what data parallelism without sharding (DDP) would hold."""

    params: int
    grads: int
    optimizer: int
    ddp_params: int
    ddp_grads: int
    ddp_optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def ddp_total(self) -> int:
        return self.ddp_params + self.ddp_grads + self.ddp_optimizer

    def describe(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:,.2f} MiB"

        ratio = self.total / self.ddp_total if self.ddp_total else 0.0
        return "\n".join(
            [
                "  memory per rank (max over ranks; DDP for comparison):",
                f"    parameters  {mib(self.params):>14}  ({self.params:,} B)   DDP {mib(self.ddp_params)}",
                f"    gradients   {mib(self.grads):>14}  ({self.grads:,} B)   DDP {mib(self.ddp_grads)}",
                f"    optimizer   {mib(self.optimizer):>14}  ({self.optimizer:,} B)   DDP {mib(self.ddp_optimizer)}",
                f"    total       {mib(self.total):>14}  = {ratio:.3f} of DDP",
            ]
        )


def local_numel(shape: tuple[int, ...], shard_size: int) -> int:
    """Elements of the largest shard of a parameter of ``shape`` split on dim 0 over ``shard_size`` ranks."""
    if not shape:
        return 1
    rows = math.ceil(shape[0] / shard_size)
    return rows * math.prod(shape[1:])


def per_rank_memory(model: nn.Module, plan: ShardingPlan, optimizer_states: int = 2) -> RankMemory:
    """Exact per-rank byte accounting of ``model`` (its paths relative to the plan's) under ``plan``."""
    params = grads = ddp_params = ddp_grads = 0
    for path, param in model.named_parameters():
        size = param.element_size()
        full = param.numel() * size
        local = full if plan.is_ignored(path) else local_numel(tuple(param.shape), plan.sharding_size) * size
        params += local
        ddp_params += full
        if param.requires_grad:
            grads += local
            ddp_grads += full
    return RankMemory(params, grads, grads * optimizer_states, ddp_params, ddp_grads, ddp_grads * optimizer_states)
