"""Doing expert parallelism: split each MoE module's experts over an EP group and route tokens to them.

The layout comes from the plan (:class:`~lightning_mm.core.sharding_plan.ExpertPlan`). Ranks form a
``(ep_replicate, ep)`` mesh: the ``ep`` ranks of one row hold one share of the experts each (``num_experts / ep``,
consecutive), and the ranks of one ``ep_replicate`` column hold the same experts. Each MoE module keeps only its
local experts (a slice of the leading experts dimension of every parameter); its forward sends each token to the
rank that owns its routed expert with an all-to-all and brings the result back the same way. Router, attention
and everything else stay data-parallel under FSDP.

Gradients: a local expert's gradient already sums the contributions of every rank of its EP group (the
all-to-all's backward brings them home). Summing that over the ``ep_replicate`` ranks and dividing by the world
size gives the data-parallel mean, i.e. the gradient of the same model trained without expert parallelism:
the routed forward scales the experts' gradients by ``1/ep`` (an autograd identity, exact for a power-of-two
``ep``; no ``PREMUL_SUM`` reduction, which gloo lacks), and then ``reshard_local_experts: true`` averages them with
FSDP over ``ep_replicate``, ``false`` keeps the local experts whole and averages their gradients over
``ep_replicate`` in :func:`all_reduce_expert_gradients`.

The call shape is Transformers 5's (``experts(hidden_states, top_k_index, top_k_weights)``, ``[tokens, hidden]``,
``[tokens, k]``, ``[tokens, k]``), used by Qwen3-MoE and Qwen3-VL-MoE; a model with another shape supplies its own
forward through ``FSDP2Mixin.expert_parallel_forward``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from lightning_mm._utils.distributed import average_in_place, local_tensor
from lightning_mm.core import parallel_layout as layout
from lightning_mm.core.module_state import expert_row_offset, keep_local_experts, replace_forward
from lightning_mm.core.sharding_plan import ShardingPlan, ep_mesh_layout
from lightning_mm.errors import LightningMMError

__all__ = [
    "ExpertParallelError",
    "ExpertGroup",
    "build_ep_mesh",
    "split_experts",
    "routed_forward",
    "apply_expert_parallel",
    "all_reduce_expert_gradients",
    "expert_row_offset",
    "expert_norm_groups",
]


class ExpertParallelError(LightningMMError, RuntimeError):
    """A MoE module that cannot be split or routed as the plan asks."""


@dataclass(frozen=True)
class ExpertGroup:
    """This rank's place in expert parallelism."""

    group: Any
    """The process group of the ``ep`` ranks that together hold all experts."""
    rank: int
    size: int
    num_experts: int

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.size

    @property
    def first_expert(self) -> int:
        return self.rank * self.experts_per_rank


def build_ep_mesh(world_size: int, expert_parallel_size: int, device_type: str) -> DeviceMesh:
    """The explicit ``(ep_replicate, ep)`` mesh (CPU included)."""
    shape, names = ep_mesh_layout(world_size, expert_parallel_size)
    return layout.device_mesh(device_type, shape, names)


def split_experts(module: nn.Module, path: str, ep: ExpertGroup) -> None:
    """Keep only this rank's experts: rows ``[first, first + per_rank)`` of every parameter's experts dimension."""
    first, count = ep.first_expert, ep.experts_per_rank
    local = {}
    for name, param in list(module.named_parameters()):
        if param.ndim == 0 or param.shape[0] != ep.num_experts:
            raise ExpertParallelError(
                f"`moe_modules` '{path}': parameter '{name}' of shape {list(param.shape)} has no leading experts "
                f"dimension of {ep.num_experts}; give the model its own `expert_parallel_forward` and layout"
            )
        rows = param.detach()[first : first + count].clone()
        local[name] = nn.Parameter(rows, requires_grad=param.requires_grad)
    keep_local_experts(module, local, first, count)  # and `num_experts`: its own forward loops over them


def _touch(module: nn.Module, received: torch.Tensor) -> torch.Tensor:
    """Zero that depends on every parameter and on the received tokens, added to the local experts' output.

    Each local expert gets a gradient even when no token reached it, so every rank reduces the same gradients; and
    the output depends on the dispatching all-to-all even when this rank received no token at all (the module's
    own forward then returns a fresh ``zeros_like``), so that all-to-all's backward runs on every rank of the EP
    group. Without it, such a rank skipped that collective and went on to the next FSDP reduce-scatter while the
    others waited in the all-to-all's backward: a deadlock. Adding zero leaves values and gradients exact.
    Transformers' ``grouped_mm`` and ``batched_mm`` kernels compute their output from the received rows even when
    there are none, so only a loop over the hit experts (its ``eager`` forward, which ``TransformersModel`` models
    run, or a custom model's ``local_forward``) needs this; the term is added whatever the kernel.
    """
    zero = received.sum() * 0.0
    for p in module.parameters():
        if p.requires_grad:
            zero = zero + p.reshape(-1)[:1].sum().to(zero.dtype) * 0.0
    return zero


class _GradScale(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def routed_forward(
    module: nn.Module, local_forward: Callable[..., torch.Tensor], ep: ExpertGroup
) -> Callable[..., torch.Tensor]:
    """A forward with Transformers' expert call shape that runs ``local_forward`` on the experts' owners.

    ``local_forward(tokens, local_index, weights)`` is the module's own forward restricted to its local experts
    (indices ``0..per_rank-1``, one per token, weight 1); the routing weights are applied where the tokens came
    from, after they return.
    """
    from lightning_mm._compat import all_to_all_single_autograd

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, hidden = hidden_states.shape
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # grouped by expert, hence by owning rank
        experts = flat[order]
        source = order // k
        send = hidden_states[source]
        send_counts = torch.bincount(experts // ep.experts_per_rank, minlength=ep.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        received = sum(recv_split)
        recv_experts = experts.new_empty(received)
        dist.all_to_all_single(recv_experts, experts, recv_split, send_split, group=ep.group)
        recv = all_to_all_single_autograd(send.contiguous(), recv_split, send_split, ep.group)
        recv = recv.view(received, hidden)
        local_index = (recv_experts - ep.first_expert).unsqueeze(1)
        ones = torch.ones(received, 1, dtype=top_k_weights.dtype, device=recv.device)
        # The local experts' gradients sum over the `ep` ranks' tokens: scale them by 1/ep here (and the tokens'
        # gradients back by ep), so that the reduction over `ep_replicate` only has to average (exact for a
        # power-of-two `ep`).
        scaled = _GradScale.apply(recv, float(ep.size))
        out = local_forward(scaled, local_index, ones)
        out = out + _touch(module, scaled).to(out.dtype)
        out = _GradScale.apply(out, 1.0 / ep.size)
        back = all_to_all_single_autograd(out.contiguous(), send_split, recv_split, ep.group)
        back = back.view(send.shape[0], hidden)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
        result = torch.zeros_like(hidden_states)
        return result.index_add(0, source, back * weights)

    return forward


def _forward_of(model: nn.Module, path: str, module: nn.Module, ep: ExpertGroup) -> Callable[..., torch.Tensor]:
    hook = getattr(model, "expert_parallel_forward", None)
    custom = hook(path, module, ep) if callable(hook) else None
    if custom is not None:
        return custom
    return routed_forward(module, module.forward, ep)


def apply_expert_parallel(
    model: nn.Module, plan: ShardingPlan, ep_mesh: DeviceMesh, fsdp_kwargs: dict[str, Any]
) -> list[nn.Parameter]:
    """Split and route every MoE module of the plan; shard the local experts over ``ep_replicate`` when the plan
    says so (before the units that contain them). Returns the expert parameters left whole (``reshard_local_experts:
    false``): the caller keeps them out of FSDP and calls :func:`all_reduce_expert_gradients` after backward."""
    experts = plan.experts
    assert experts is not None
    ep = ExpertGroup(
        ep_mesh.get_group("ep"), ep_mesh.get_local_rank("ep"), experts.expert_parallel_size, experts.num_experts
    )
    kept: list[nn.Parameter] = []
    # With CPU offload, whole local experts are an FSDP unit over this rank alone: FSDP keeps them (and their
    # gradients and optimiser step) on the CPU and brings them to the device for forward and backward, as it does
    # for every other unit; their gradients are still averaged over ep_replicate by all_reduce_expert_gradients.
    offloaded = isinstance(fsdp_kwargs.get("offload_policy"), CPUOffloadPolicy)
    alone = own_rank_mesh(ep_mesh.device_type) if offloaded and not experts.reshard_local_experts else None
    for path in experts.moe_modules:
        module = model.get_submodule(path)
        split_experts(module, path, ep)
        replace_forward(module, _forward_of(model, path, module, ep), "expert parallelism (token routing)")
        if experts.reshard_local_experts or alone is not None:
            kwargs = copy.copy(fsdp_kwargs)
            # averages over ep_replicate (the routed forward did the 1/ep), or over this rank alone (kept whole)
            kwargs.update(mesh=alone if alone is not None else ep_mesh["ep_replicate"], ignored_params=None)
            fully_shard(module, **kwargs)
        if not experts.reshard_local_experts:
            kept.extend(module.parameters())
    return kept


def own_rank_mesh(device_type: str) -> DeviceMesh:
    """A 1-rank mesh of this rank alone (every rank calls this: it creates one process group per rank)."""
    return layout.own_rank_mesh(device_type)


def all_reduce_expert_gradients(params: list[nn.Parameter], ep_mesh: DeviceMesh) -> None:
    """Average the whole local experts' gradients over ``ep_replicate`` (the routed forward scaled them by 1/ep)."""
    if ep_mesh.size(0) > 1:  # DTensors of a 1-rank mesh when offloaded: their local tensors
        average_in_place(
            [local_tensor(p.grad) for p in params if p.grad is not None], ep_mesh.get_group("ep_replicate")
        )


def broadcast_expert_replicas(params: list[nn.Parameter], ep_mesh: DeviceMesh) -> None:
    """Whole local experts equal on the ranks of an ``ep_replicate`` column (the first one's values win)."""
    if ep_mesh.size(0) == 1:
        return
    group = ep_mesh.get_group("ep_replicate")
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in params:
            dist.broadcast(local_tensor(p.data), src=src, group=group)


def expert_norm_groups(target: nn.Module, plan: ShardingPlan, ep_mesh: DeviceMesh) -> dict[int, tuple[Any, ...]]:
    """``id(parameter)`` -> ``(ep group,)`` for every local expert parameter: the ranks of an EP group hold other
    experts, so a gradient norm sums their terms over it (besides the dimensions FSDP shards them along)."""
    assert plan.experts is not None
    if ep_mesh.size(1) == 1:
        return {}
    group = ep_mesh.get_group("ep")
    return {id(p): (group,) for path in plan.experts.moe_modules for p in target.get_submodule(path).parameters()}


# ---------------------------------------------------------------------------------------------- checkpoints
def expert_state_names(root: nn.Module, plan: ShardingPlan, target: nn.Module) -> set[str]:
    """Fully qualified names (relative to ``root``) of the expert parameters, as state dicts key them."""
    assert plan.experts is not None
    experts = {id(target.get_submodule(path)) for path in plan.experts.moe_modules}
    names: set[str] = set()
    for prefix, module in root.named_modules():
        if id(module) in experts:
            names.update(f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters())
    return names


class ExpertCheckpointLayout:
    """Saves the local experts as their share of the global tensor (all experts), so that a checkpoint of an EP run
    loads without expert parallelism or with another ``expert_parallel_size`` (DCP reshards), and loads them from it.

    Whole local experts (``reshard_local_experts: false``) are ``[Replicate, Shard(0)]`` on ``(ep_replicate, ep)``;
    FSDP-sharded ones are ``[Shard(0), Shard(0)]`` on ``(ep, ep_replicate)`` (the experts split over ``ep`` first,
    each share's rows then over ``ep_replicate``, as FSDP chunks them). Those global tensors are views of the local
    ones (:meth:`DTensor.from_local` shares the storage), so a checkpoint read into them fills the model's and the
    optimiser's own tensors: any ``expert_parallel_size`` (1 included) reads any other.
    """

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int, names: set[str]) -> None:
        self.ep_mesh = ep_mesh
        self.num_experts = num_experts
        self.names = names
        """State-dict names of the expert parameters (:func:`expert_state_names`)."""
        self.ep_size = ep_mesh.size(1)
        # Every rank builds it (new process groups): an ordinary collective, once per run.
        self.transposed = layout.transposed_mesh(ep_mesh, ("ep", "ep_replicate"))

    def to_global(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's local experts (a plain tensor, or FSDP's shard of them) as its share of all experts."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shape = torch.Size([tensor.shape[0] * self.ep_size, *tensor.shape[1:]])  # a DTensor: its local experts
        if shape[0] != self.num_experts:
            return tensor
        stride = torch.empty(shape, device="meta").stride()
        if isinstance(tensor, DTensor):
            if tensor.device_mesh.size() == 1:  # a 1-rank FSDP mesh holds them whole (CPU offload; ep = world)
                tensor = tensor.to_local()
            else:
                return DTensor.from_local(
                    tensor.to_local(),
                    self.transposed,
                    [Shard(0), Shard(0)],
                    run_check=False,
                    shape=shape,
                    stride=stride,
                )
        return DTensor.from_local(
            tensor, self.ep_mesh, [Replicate(), Shard(0)], run_check=False, shape=shape, stride=stride
        )

    def model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A model state dict with the expert parameters as global tensors (views)."""
        return {
            k: (self.to_global(v) if k in self.names and isinstance(v, torch.Tensor) else v) for k, v in state.items()
        }

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A name-keyed optimiser state dict with the experts' state tensors (not ``step``) as global tensors."""
        per_param = state.get("state", {})
        converted = {
            key: (
                {k: (self.to_global(v) if isinstance(v, torch.Tensor) and v.ndim > 0 else v) for k, v in value.items()}
                if key in self.names and isinstance(value, dict)
                else value
            )
            for key, value in per_param.items()
        }
        return {**state, "state": converted}
