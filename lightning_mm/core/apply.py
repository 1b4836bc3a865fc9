"""Doing the sharding: apply a :class:`~lightning_mm.core.sharding_plan.ShardingPlan` to a model with torch.

:func:`apply_plan` is the whole of it, as torchtitan's ``parallelize``: a short sequence of one function per
concern (recomputation, the ignored modules, expert parallelism, ``fully_shard`` of the units and then the root,
meta-device materialisation and init, prefetch). The mesh comes first (:func:`build_device_mesh`), when the
processes start. Lightning-free.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_mm._compat import fsdp_state, is_rng_supported_mesh
from lightning_mm._utils.distributed import local_tensor as _local
from lightning_mm._utils.suggestions import listing
from lightning_mm.core import expert_parallel
from lightning_mm.core.compile import compiled_forward, is_compiled
from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.ignored import IgnoredModules
from lightning_mm.core.module_state import describe_module_changes, move_buffer, replace_forward, set_fsdp2_config
from lightning_mm.core.parallel_layout import LayoutMeshes, device_mesh
from lightning_mm.core.recompute import checkpointed_forward, is_recomputed
from lightning_mm.core.sharding_plan import ShardingPlan, mesh_layout, plan_in_use
from lightning_mm.core.tensor_parallel import apply_tensor_parallel
from lightning_mm.core.torch_init import init_like_constructors
from lightning_mm.errors import LightningMMError

__all__ = [
    "build_device_mesh",
    "apply_plan",
    "ShardedModel",
    "model_unit_sharding",
    "fsdp_kwargs",
    "apply_compile",
    "apply_recompute",
    "apply_experts",
    "apply_fully_shard",
    "materialize",
    "Unit",
    "plan_units",
    "sharded_units",
    "ExecutionOrderPrefetch",
    "materialize_and_init",
    "shard_distinct_rng",
    "broadcast_replicated",
    "MaterializationError",
]

log = logging.getLogger(__name__)


class MaterializationError(LightningMMError, RuntimeError):
    """Meta-device parameters or buffers that no init function filled."""


# ----------------------------------------------------------------------------------------------------- mesh
def build_device_mesh(world_size: int, sharding_size: int, device_type: str) -> DeviceMesh:
    """A 1-D ``(shard,)`` mesh for FSDP or a 2-D ``(replicate, shard)`` mesh for HSDP, on ``device_type``.

    The mesh is always explicit, CPU included (a gloo run without one picks the wrong device).
    """
    shape, names = mesh_layout(world_size, sharding_size)
    return device_mesh(device_type, shape, names)


# ------------------------------------------------------------------------------------------ the sequence
@dataclass
class ShardedModel:
    """What applying a plan leaves for the run: the parameters FSDP does not reduce, and the prefetching."""

    ignored: IgnoredModules
    prefetch: ExecutionOrderPrefetch
    ep_mesh: DeviceMesh | None = None
    whole_experts: list[nn.Parameter] = field(default_factory=list)
    """Local experts kept whole (``reshard_local_experts: false``): out of FSDP, reduced over ``ep_replicate``."""
    norm_groups: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    """``id(parameter)`` -> process groups its gradient-norm term is summed over beyond its placements (the
    ``ep`` group for every local expert: each rank of it holds other experts)."""

    def reduce_unsharded_gradients(self) -> None:
        """After the backward of the last micro-batch: average the gradients FSDP does not reduce."""
        self.ignored.all_reduce_gradients()
        if self.whole_experts:
            assert self.ep_mesh is not None
            expert_parallel.all_reduce_expert_gradients(self.whole_experts, self.ep_mesh)


def apply_plan(
    root: nn.Module,
    target: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    device: torch.device,
    shard_units: Callable[[dict[str, Any]], None] | None = None,
    meshes: LayoutMeshes | None = None,
) -> ShardedModel:
    """Apply ``plan`` to ``target`` (the module its paths are relative to) inside ``root`` (the FSDP root).

    ``device`` is the compute device. ``shard_units`` replaces the sharding of the plan's units (a model's own
    ``_fully_shard``, see :func:`model_unit_sharding`); the root is sharded here either way. ``meshes``: the run's
    mesh builder (``mesh`` is its data-parallel mesh); without it, one for the plan's layout.
    """
    if meshes is None:
        meshes = LayoutMeshes(plan.layout, mesh.device_type)
    ignored = IgnoredModules(target, plan)
    apply_compile(target, plan)  # the block's own forward; recomputation wraps the compiled forward
    apply_recompute(target, plan)
    ignored.cast_inputs()
    if plan.tp_plan:  # DTensors over tp first; fully_shard then shards them over the data-parallel mesh (2-D)
        apply_tensor_parallel(target, dict(plan.tp_plan), meshes.tensor_parallel)
    kwargs = fsdp_kwargs(plan, mesh, ignored.parameters())
    ep_mesh, whole = apply_experts(target, plan, meshes, kwargs)  # before the units containing experts
    if whole:  # kept whole: out of FSDP, reduced after backward
        kwargs = fsdp_kwargs(plan, mesh, ignored.parameters() | set(whole))
    apply_fully_shard(target, root, plan, kwargs, shard_units)
    whole = materialize(root, target, plan, mesh, device, ignored, ep_mesh if whole else None)
    load_after_sharding = getattr(target, "load_after_sharding", None)  # FSDP2Mixin: pretrained shards
    if callable(load_after_sharding):
        load_after_sharding()
    units = plan_units(target, plan) if shard_units is None else sharded_units(target, root)
    prefetch = ExecutionOrderPrefetch(root, units, plan)
    norm_groups = expert_parallel.expert_norm_groups(target, plan, ep_mesh) if ep_mesh is not None else {}
    changes = describe_module_changes(target)
    if changes:
        log.info(changes)
    return ShardedModel(ignored, prefetch, ep_mesh, whole, norm_groups)


def model_unit_sharding(
    target: nn.Module, config: FSDP2Config, plan: ShardingPlan | None = None
) -> Callable[[dict[str, Any]], None] | None:
    """The model's own wrapping of its sub-modules (MindSpeed MM's ``_fully_shard(fsdp2_kwargs, fsdp2_config)``), or
    ``None`` when it has none or keeps ``FSDP2Mixin``'s default (which shards the plan's units, as
    :func:`apply_fully_shard` does). ``target.fsdp2_config`` is set before the call, as in MindSpeed MM
    (:func:`~lightning_mm.core.module_state.set_fsdp2_config`). With ``plan`` (built from ``config`` for
    ``target``), a ``build_plan`` inside the call (``FSDP2Mixin._fully_shard`` through ``super()``) returns that
    plan rather than resolving the patterns again (:func:`~lightning_mm.core.sharding_plan.plan_in_use`)."""
    custom = getattr(target, "_fully_shard", None)
    if not callable(custom) or getattr(custom, "shards_plan_units", False):
        return None

    def shard_units(kwargs: dict[str, Any]) -> None:
        set_fsdp2_config(target, config)
        with plan_in_use(config, target, plan) if plan is not None else contextlib.nullcontext():
            custom(fsdp2_kwargs=kwargs, fsdp2_config=config)

    return shard_units


def fsdp_kwargs(plan: ShardingPlan, mesh: DeviceMesh, kept_whole: set[nn.Parameter]) -> dict[str, Any]:
    """The keyword arguments every ``fully_shard`` call of this plan gets; ``kept_whole``: FSDP's ``ignored_params``
    (the ignored modules' parameters, and local experts kept whole)."""
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
        "ignored_params": kept_whole or None,
    }


# ------------------------------------------------------------------------------------------- recomputation
def apply_compile(model: nn.Module, plan: ShardingPlan) -> None:
    """Compile the forward of each ``compile_modules`` module as one graph (see :mod:`lightning_mm.core.compile`)."""
    for path in plan.compile_modules:
        module = model.get_submodule(path)
        if not is_compiled(module.forward):
            replace_forward(module, compiled_forward(module.forward, plan.compile_backend, path), "compile_modules")


def apply_recompute(model: nn.Module, plan: ShardingPlan) -> None:
    """Recompute the activations of each ``recompute_modules`` module in backward (module names unchanged).

    The gradients equal those without recomputation for either ``use_reentrant`` value; see
    :mod:`lightning_mm.core.recompute` (a key/value cache is not used in recomputed calls).
    """
    for path in plan.recompute_modules:
        module = model.get_submodule(path)
        if is_recomputed(module):
            continue
        replace_forward(module, checkpointed_forward(module.forward, plan.use_reentrant, path), "recompute_modules")


# ------------------------------------------------------------------------------------- expert parallelism
def apply_experts(
    model: nn.Module, plan: ShardingPlan, meshes: LayoutMeshes, kwargs: dict[str, Any]
) -> tuple[DeviceMesh | None, list[nn.Parameter]]:
    """Split and route the plan's MoE modules over the expert mesh (before the units that contain them are
    sharded): the expert mesh and the expert parameters kept whole (:mod:`~lightning_mm.core.expert_parallel`).
    """
    if plan.experts is None:
        return None, []
    ep_mesh = meshes.expert_parallel
    return ep_mesh, expert_parallel.apply_expert_parallel(model, plan, ep_mesh, kwargs)


# ------------------------------------------------------------------------------------------------ sharding
def apply_fully_shard(
    model: nn.Module,
    root: nn.Module,
    plan: ShardingPlan,
    kwargs: dict[str, Any],
    shard_units: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """``fully_shard`` every unit of the plan (children first, shared-parameter groups together), then the root.

    ``model`` is what the plan's paths are relative to; ``root`` is the module whose forward drives a step.
    ``shard_units`` (a model's own ``_fully_shard``) shards the units instead of the plan's. Units the plan marks
    ``keep_unsharded``, and the root when ``plan.keep_unsharded_for_backward``, are not resharded after forward.
    """
    if shard_units is not None:
        shard_units(kwargs)
    else:
        for unit in plan.units:
            modules = [model.get_submodule(path) for path in unit.modules]
            unit_kwargs = {**kwargs, "reshard_after_forward": False} if unit.keep_unsharded else kwargs
            fully_shard(modules if len(modules) > 1 else modules[0], **unit_kwargs)
    root_kwargs = {**kwargs, "reshard_after_forward": False} if plan.keep_unsharded_for_backward else kwargs
    fully_shard(root, **root_kwargs)


@dataclass(frozen=True, eq=False)
class Unit:
    """One ``fully_shard`` call's modules (the first stands for the unit), by the name it is logged under."""

    name: str
    modules: tuple[nn.Module, ...]
    manages_parameters: bool
    """Whether ``fully_shard`` gave it parameters of its own (a unit may have none, e.g. a RoPE table)."""


def plan_units(model: nn.Module, plan: ShardingPlan) -> list[Unit]:
    """The units :func:`apply_fully_shard` and :func:`apply_experts` made from the plan (the root excepted)."""
    units = [
        Unit(unit.modules[0], tuple(model.get_submodule(p) for p in unit.modules), unit.num_params > 0)
        for unit in plan.units
    ]
    if plan.experts is not None and plan.experts.reshard_local_experts:  # each MoE module sharded on its own
        units += [Unit(path, (model.get_submodule(path),), True) for path in plan.experts.moe_modules]
    return units


def sharded_units(model: nn.Module, root: nn.Module) -> list[Unit]:
    """The units a model's own ``_fully_shard`` made, which the plan does not know: its ``FSDPModule`` s.

    Modules sharded by one call share one FSDP state; telling them apart has no public API, so this (and only this)
    asks FSDP's state (``lightning_mm._compat.fsdp_state``).
    """
    by_state: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if _is_fsdp_module(module) and module is not root:
            by_state.setdefault(id(fsdp_state(module)), []).append((name or "<root>", module))
    return [
        Unit(members[0][0], tuple(m for _, m in members), _holds_sharded_parameters(m for _, m in members))
        for members in by_state.values()
    ]


def _is_fsdp_module(module: nn.Module) -> bool:
    # Not an isinstance check inline: mypy narrows the module to FSDPModule (a mixin), dropping nn.Module.
    return isinstance(module, FSDPModule)


def _holds_sharded_parameters(modules: Iterable[nn.Module]) -> bool:
    """Whether parameters of ``modules`` outside nested FSDP units are sharded (DTensors): FSDP manages them."""

    def own(module: nn.Module) -> Iterator[nn.Parameter]:
        yield from module.parameters(recurse=False)
        for child in module.children():
            if not isinstance(child, FSDPModule):
                yield from own(child)

    return any(isinstance(p, DTensor) for module in modules for p in own(module))


# ------------------------------------------------------------------------------------------------ prefetch
class ExecutionOrderPrefetch:
    """Sets explicit FSDP2 prefetching from the order in which units actually run.

    Each unit records itself when its forward starts during the first forward pass through ``root``; when that
    pass ends, unit *i* prefetches the next ``plan.num_to_forward_prefetch`` units in forward and the previous
    ``plan.num_to_backward_prefetch`` units in backward. (Registration order, which the replaced system uses, is
    often not execution order.)

    With ``plan.keep_unsharded_for_backward`` the last unit to run forward (that has parameters) keeps them
    unsharded from its forward to its backward, as the root does (:func:`apply_fully_shard`).
    """

    def __init__(self, root: nn.Module, units: Iterable[Unit], plan: ShardingPlan) -> None:
        self.num_to_forward_prefetch = plan.num_to_forward_prefetch
        self.num_to_backward_prefetch = plan.num_to_backward_prefetch
        self.keep_unsharded_for_backward = plan.keep_unsharded_for_backward
        self.root = root
        self.units = list(units)
        self.names = {id(unit.modules[0]): unit.name for unit in self.units}
        self.kept_unsharded: list[nn.Module] = [root] if plan.keep_unsharded_for_backward else []
        self.order: list[FSDPModule] = []
        self._ran: list[Unit] = []
        self._handles = [
            module.register_forward_pre_hook(self._recorder(unit))
            for unit in self.units
            for module in unit.modules
            if module is not root
        ]
        self._handles.append(root.register_forward_hook(self._finish))

    def _recorder(self, unit: Unit) -> Callable[..., None]:
        def record(*_: Any) -> None:
            if unit not in self._ran:  # a unit of several modules records when the first of them runs
                self._ran.append(unit)
                self.order.append(unit.modules[0])  # type: ignore[arg-type]

        return record

    def _finish(self, *_: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        # The root is fully_shard-ed (an FSDPModule) before this hook runs; nn.Module is its declared type.
        order: list[FSDPModule] = [cast(FSDPModule, self.root), *self.order]
        for i, unit in enumerate(order):
            if self.num_to_forward_prefetch:
                unit.set_modules_to_forward_prefetch(order[i + 1 : i + 1 + self.num_to_forward_prefetch])
        reverse = order[::-1]
        for i, unit in enumerate(reverse):
            if self.num_to_backward_prefetch:  # 0 keeps FSDP2's implicit prefetch of the previous unit
                unit.set_modules_to_backward_prefetch(reverse[i + 1 : i + 1 + self.num_to_backward_prefetch])
        if self.keep_unsharded_for_backward:
            last = next((u.modules[0] for u in reversed(self._ran) if u.manages_parameters), None)
            if last is not None:
                last.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
                self.kept_unsharded.append(last)
        if self.order:
            log.info("FSDP2 prefetch order (forward): %s", " -> ".join(self.name(u) for u in self.order))
        if self.kept_unsharded:
            log.info(
                "FSDP2 units kept unsharded from forward to backward (needed first in backward): %s",
                ", ".join("<root>" if u is self.root else self.name(u) for u in self.kept_unsharded),
            )

    def name(self, unit: nn.Module | FSDPModule) -> str:
        return self.names.get(id(unit), type(unit).__name__)


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
                move_buffer(module, name, buf.to(device))


def materialize_and_init(
    root: nn.Module,
    init_target: nn.Module,
    param_device: torch.device,
    compute_device: torch.device,
    init_fn: Callable[[nn.Module], None] = default_init,
) -> list[str]:
    """Give meta tensors real storage on ``param_device`` and initialise them; keep every real tensor as it was.

    Buffers end up on ``compute_device`` (it differs from ``param_device`` when parameters are offloaded to CPU).
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
    return meta


def materialize(
    root: nn.Module,
    target: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    device: torch.device,
    ignored: IgnoredModules,
    ep_mesh: DeviceMesh | None = None,
) -> list[nn.Parameter]:
    """Materialise and initialise what was built on the meta device, then make the unsharded tensors agree.

    Parameters live on ``device`` (on the CPU when offloaded), buffers and the ignored modules on ``device``.
    Plain tensors that were materialised take rank 0's values; local experts kept whole (``ep_mesh`` given) take
    those of the first rank of their ``ep_replicate`` column instead. Returns the whole local experts' parameters
    (collected after materialisation, which may replace parameter objects).
    """
    param_device = torch.device("cpu") if plan.offload_to_cpu else device
    with shard_distinct_rng(mesh):
        materialized = materialize_and_init(root, target, param_device, device)
    ignored.place(device)
    whole: list[nn.Parameter] = []
    if ep_mesh is not None:  # local experts differ along `ep`: equal only within an ep_replicate column
        assert plan.experts is not None
        whole = [p for m in plan.experts.moe_modules for p in target.get_submodule(m).parameters()]
        ids = {id(p) for p in whole}
        names = dict(root.named_parameters())
        materialized = [n for n in materialized if id(names.get(n)) not in ids]
        expert_parallel.broadcast_expert_replicas(whole, ep_mesh)
    broadcast_replicated(root, materialized)
    return whole


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
