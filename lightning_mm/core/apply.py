"""Doing the sharding: apply a :class:`~lightning_mm.core.plan.ShardingPlan` to a model with torch.

One short function per concern, in the order the strategy calls them: mesh, recomputation, ``fully_shard`` of
the units and then the root, prefetch, and meta-device materialisation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_mm._compat import fsdp_param_groups, fsdp_state, is_rng_supported_mesh
from lightning_mm._dtensor import local_tensor as _local
from lightning_mm._names import listing
from lightning_mm.core.plan import ShardingPlan, mesh_layout
from lightning_mm.core.recompute import checkpointed_forward, is_recomputed
from lightning_mm.core.torch_init import init_like_constructors

__all__ = [
    "build_device_mesh",
    "fsdp_kwargs",
    "ignored_parameters",
    "apply_ignored_input_cast",
    "apply_recompute",
    "apply_fully_shard",
    "ExecutionOrderPrefetch",
    "materialize_and_init",
    "all_reduce_gradients",
    "shard_distinct_rng",
    "broadcast_replicated",
    "MaterializationError",
]

log = logging.getLogger(__name__)


class MaterializationError(RuntimeError):
    """Meta-device parameters or buffers that no init function filled."""


# ----------------------------------------------------------------------------------------------------- mesh
def build_device_mesh(world_size: int, sharding_size: int, device_type: str) -> DeviceMesh:
    """A 1-D ``(shard,)`` mesh for FSDP or a 2-D ``(replicate, shard)`` mesh for HSDP, on ``device_type``.

    The mesh is always explicit, CPU included (a gloo run without one picks the wrong device).
    """
    shape, names = mesh_layout(world_size, sharding_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def fsdp_kwargs(plan: ShardingPlan, mesh: DeviceMesh, ignored_params: set[nn.Parameter]) -> dict[str, Any]:
    """The keyword arguments every ``fully_shard`` call of this plan gets."""
    mp = plan.precision
    return {
        "mesh": mesh,
        "reshard_after_forward": plan.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            output_dtype=mp.output_dtype,
            cast_forward_inputs=mp.cast_forward_inputs,
        ),
        "offload_policy": CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.offload_to_cpu else OffloadPolicy(),
        "ignored_params": ignored_params or None,
    }


def ignored_parameters(model: nn.Module, plan: ShardingPlan) -> set[nn.Parameter]:
    """Parameters of the plan's ignored modules: kept whole on every rank, never sharded."""
    return {p for path in plan.ignored for p in model.get_submodule(path).parameters()}


def _cast_inputs_to_own_dtype(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return args, kwargs

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def apply_ignored_input_cast(modules: Iterable[nn.Module], plan: ShardingPlan) -> None:
    """Ignored modules get no mixed-precision policy and compute in their own parameter dtype.

    FSDP casts each unit's floating inputs to ``param_dtype``; an ignored module's inputs are cast to its own
    parameter dtype instead, so that it keeps working when the root casts the batch.
    """
    if plan.precision.cast_forward_inputs and plan.precision.param_dtype is not None:
        for module in modules:
            module.register_forward_pre_hook(_cast_inputs_to_own_dtype, with_kwargs=True)


# ------------------------------------------------------------------------------------------- recomputation
def apply_recompute(model: nn.Module, plan: ShardingPlan) -> None:
    """Recompute the activations of each ``recompute_modules`` module in backward (module names unchanged).

    The gradients equal those without recomputation for either ``use_reentrant`` value; see
    :mod:`lightning_mm.core.recompute` (a key/value cache is not used in recomputed calls).
    """
    for path in plan.recompute:
        module = model.get_submodule(path)
        if is_recomputed(module):
            continue
        module.forward = checkpointed_forward(module.forward, plan.use_reentrant, path)


# ------------------------------------------------------------------------------------------------ sharding
def apply_fully_shard(model: nn.Module, root: nn.Module, plan: ShardingPlan, kwargs: dict[str, Any]) -> None:
    """``fully_shard`` every unit of the plan (children first, shared-parameter groups together), then the root.

    ``model`` is what the plan's paths are relative to; ``root`` is the module whose forward drives a step.
    """
    for unit in plan.units:
        modules = [model.get_submodule(path) for path in unit.modules]
        unit_kwargs = {**kwargs, "reshard_after_forward": False} if unit.keep_unsharded else kwargs
        fully_shard(modules if len(modules) > 1 else modules[0], **unit_kwargs)
    fully_shard(root, **kwargs)


def fsdp_units(root: nn.Module) -> list[FSDPModule]:
    """Every module carrying its own FSDP state below (and including) ``root``, one per state."""
    seen: set[int] = set()
    units = []
    for module in root.modules():
        if isinstance(module, FSDPModule):
            state = fsdp_state(module)
            if id(state) not in seen:
                seen.add(id(state))
                units.append(module)
    return units


# ------------------------------------------------------------------------------------------------ prefetch
class ExecutionOrderPrefetch:
    """Sets explicit FSDP2 prefetching from the order in which units actually run.

    Each unit records itself when its forward starts during the first forward pass through ``root``; when that
    pass ends, unit *i* prefetches the next ``forward`` units in forward and the previous ``backward`` units in
    backward. (Registration order, which the replaced system uses, is often not execution order.)

    With ``keep_unsharded_for_backward`` (the default) the root and the last unit to run forward keep their
    parameters unsharded from their forward to their backward: backward needs them first, so resharding them
    would only all-gather the same parameters again at once (two all-gathers per step saved; see
    benchmarks/README.md). Every other unit follows ``reshard_after_forward``.
    """

    def __init__(self, root: nn.Module, units: Iterable[FSDPModule], forward: int, backward: int,
                 names: dict[int, str] | None = None, keep_unsharded_for_backward: bool = True) -> None:
        self.forward = forward
        self.backward = backward
        self.names = names or {}
        self.keep_unsharded_for_backward = keep_unsharded_for_backward
        self.kept_unsharded: list[nn.Module] = []
        self.order: list[FSDPModule] = []
        self._seen: set[int] = set()
        self._handles = [u.register_forward_pre_hook(self._record) for u in units if u is not root]
        self._handles.append(root.register_forward_hook(self._finish))
        self.root = root
        if keep_unsharded_for_backward and isinstance(root, FSDPModule):
            root.set_reshard_after_forward(False, recurse=False)
            self.kept_unsharded.append(root)

    def _record(self, module: nn.Module, *_: Any) -> None:
        state = id(fsdp_state(module))
        if state not in self._seen:
            self._seen.add(state)
            self.order.append(module)  # type: ignore[arg-type]

    def _finish(self, *_: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        order = [self.root, *self.order]
        for i, unit in enumerate(order):
            if self.forward:
                unit.set_modules_to_forward_prefetch(order[i + 1 : i + 1 + self.forward])
        reverse = order[::-1]
        for i, unit in enumerate(reverse):
            if self.backward:  # 0 keeps FSDP2's implicit prefetch of the previous unit
                unit.set_modules_to_backward_prefetch(reverse[i + 1 : i + 1 + self.backward])
        if self.keep_unsharded_for_backward:
            last = next((u for u in reversed(self.order) if _manages_parameters(u)), None)
            if last is not None:
                last.set_reshard_after_forward(False, recurse=False)
                self.kept_unsharded.append(last)
        if self.order:
            log.info("FSDP2 prefetch order (forward): %s", " -> ".join(self.name(u) for u in self.order))
        if self.kept_unsharded:
            log.info("FSDP2 units kept unsharded from forward to backward (needed first in backward): %s",
                     ", ".join("<root>" if u is self.root else self.name(u) for u in self.kept_unsharded))

    @property
    def done(self) -> bool:
        return not self._handles

    def name(self, unit: nn.Module) -> str:
        return self.names.get(id(unit), type(unit).__name__)


def _manages_parameters(unit: FSDPModule) -> bool:
    """Whether ``fully_shard`` gave this unit parameters of its own (a unit may have none, e.g. a RoPE table)."""
    return bool(fsdp_param_groups(fsdp_state(unit)))


# --------------------------------------------------------------------------------------- materialisation
def _is_meta(t: torch.Tensor) -> bool:
    return _local(t).is_meta


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _fill_sentinel(t: torch.Tensor) -> None:
    local = _local(t)
    if local.is_floating_point() or local.is_complex():
        local.fill_(math.nan)
    elif local.dtype != torch.bool:
        local.fill_(torch.iinfo(local.dtype).min)


def _still_sentinel(t: torch.Tensor) -> bool:
    local = _local(t)
    if local.numel() == 0 or local.dtype == torch.bool:
        return False
    if local.is_floating_point() or local.is_complex():
        return bool(torch.isnan(local).all())
    return bool((local == torch.iinfo(local.dtype).min).all())


def default_init(model: nn.Module) -> None:
    """``model.init_weights()`` (WeightInitMixin) if it has one, else every module initialised as its
    constructor does, children first (:func:`~lightning_mm.core.torch_init.init_like_constructors`:
    ``reset_parameters()``, and torch's ``_reset_parameters()`` of ``nn.MultiheadAttention``/``nn.Transformer``)."""
    init_weights = getattr(model, "init_weights", None)
    if callable(init_weights):
        init_weights()
        return
    init_like_constructors(model)


def _move_buffers(root: nn.Module, device: torch.device) -> None:
    for module in root.modules():
        for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if buf is not None and buf.device != device:
                setattr(module, name, buf.to(device))  # an existing buffer: stays a buffer, keeps its persistence


def materialize_and_init(
    root: nn.Module,
    init_target: nn.Module,
    param_device: torch.device,
    compute_device: torch.device,
    ignored_modules: Iterable[nn.Module] = (),
    init_fn: Callable[[nn.Module], None] = default_init,
) -> list[str]:
    """Give meta tensors real storage on ``param_device`` and initialise them; keep every real tensor as it was.

    Buffers and ignored modules end up on ``compute_device`` (they differ when parameters are offloaded to CPU).
    Anything that was on the meta device and that ``init_fn`` leaves unfilled is an error naming it.
    Returns the names of the tensors that were materialised.
    """
    tensors = _named_tensors(root)
    meta = [name for name, t in tensors.items() if _is_meta(t)]
    if meta:
        real = {name: t for name, t in tensors.items() if name not in meta}
        # Only modules that hold meta tensors themselves: a module-wide ``to_empty`` would also empty state that is
        # neither parameter nor buffer (torchmetrics keeps its metric states that way, and moves them in ``_apply``).
        for module in root.modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if any(_is_meta(t) for t in own):
                module.to_empty(device=param_device, recurse=False)
        with torch.no_grad():
            fresh = _named_tensors(root)
            for name in meta:
                _fill_sentinel(fresh[name])
            init_fn(init_target)
            fresh = _named_tensors(root)
            missing = [name for name in meta if _still_sentinel(fresh[name])]
            if missing:
                shown = listing(missing, 12)
                raise MaterializationError(
                    f"{len(missing)} tensor(s) built on the meta device were not initialised: {shown}. Give the "
                    "model an `init_weights()` (lightning_mm.modules.WeightInitMixin) or give those modules a "
                    "`reset_parameters()`, or build them outside the meta-device context (empty_init=False)."
                )
            for name, old in real.items():
                _local(fresh[name]).copy_(_local(old).to(_local(fresh[name]).device))
    _move_buffers(root, compute_device)
    for module in ignored_modules:
        module.to(compute_device)
    return meta


_CPU_MESH_RNG_WARNING = "DTensor random operators may not have complete support"


@contextlib.contextmanager
def shard_distinct_rng(mesh: DeviceMesh) -> Iterator[None]:
    """Random init that differs between shards and agrees between replicas, on meshes DTensor cannot seed.

    DTensor's random ops keep per-shard RNG offsets only on CUDA-like devices; on a CPU mesh every rank would draw
    the same numbers, so all shards of a weight would be equal. Here the default generator is seeded, for the
    duration of the init, with rank 0's seed plus this rank's coordinate on the shard dimension (the same on HSDP
    replicas). The previous RNG state is restored afterwards.
    """
    with warnings.catch_warnings():  # torch warns about CPU meshes: the case this function handles
        warnings.filterwarnings("ignore", message=_CPU_MESH_RNG_WARNING)
        supported = is_rng_supported_mesh(mesh)
    if supported:
        yield
        return
    base = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.long)
    if dist.is_initialized():
        dist.broadcast(base, src=0)
    shard = mesh.get_local_rank("shard") if "shard" in (mesh.mesh_dim_names or ()) else mesh.get_local_rank()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CPU_MESH_RNG_WARNING)  # DTensor's init ops repeat it
        torch.manual_seed(int(base.item()) + 7919 * shard)
        yield


def broadcast_replicated(root: nn.Module, names: Iterable[str]) -> None:
    """Make plain (non-DTensor) tensors identical on every rank: rank 0's values win (ignored modules, buffers)."""
    if not dist.is_initialized():
        return
    tensors = _named_tensors(root)
    with torch.no_grad():
        for name in names:
            tensor = tensors[name]
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor.data, src=0)


# ------------------------------------------------------------------------------------- gradient sync
def all_reduce_gradients(params: Iterable[nn.Parameter], group: Any = None) -> None:
    """Average the gradients of unsharded (ignored) parameters across the data-parallel ranks."""
    if not dist.is_initialized():
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    world = dist.get_world_size(group)
    for grads in buckets.values():  # one collective per dtype and device
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
