"""One sharded run, Lightning-free: config in force -> plan -> applied model -> its step and checkpoint views.

:class:`ShardedRun` owns what a run decides and what applying it leaves behind: which FSDP2 config is in force (the
strategy's, the LightningModule's, or the default), the model's own defaults merged in, the precision policy, the
:class:`~lightning_mm.core.sharding_plan.ShardingPlan`, the applied sharding (ignored modules, experts, norm groups,
prefetch) and the views checkpoints take of local experts. ``MMFSDP2Strategy`` is the Lightning lifecycle around
one ``ShardedRun``; ``lightning-mm plan`` calls the same :func:`plan_run`, so the plan it prints is the plan the
strategy builds.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_mm.core import apply
from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.memory_check import check_parameters_fit
from lightning_mm.core.parallel_layout import LayoutMeshes, config_layout
from lightning_mm.core.precision_policy import PrecisionPolicy, resolve_precision_policy
from lightning_mm.core.sharding_plan import ShardingPlan, build_plan
from lightning_mm.errors import ConfigError, StateError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mm.core.expert_parallel import ExpertCheckpointLayout

__all__ = ["PlannedRun", "data_parallel_sampler_kwargs", "ShardedRun", "plan_run", "resolve_config", "sharding_target"]


def sharding_target(module: nn.Module) -> nn.Module:
    """The module a config's paths are relative to: ``module.sharding_target()`` when it has that method (for
    ``MMLightningModule``, its ``model``), else ``module`` itself."""
    method = getattr(module, "sharding_target", None)
    return method() if callable(method) else module


ConfigReader = Callable[[Any], FSDP2Config]
"""What reads a config given as a path, a dict or a config (:meth:`FSDP2Config.load`; the strategy passes the
translation layer's entry, which also reads MindSpeed MM's native form)."""


def resolve_config(
    given: FSDP2Config | None, module: nn.Module | None, read: ConfigReader = FSDP2Config.load
) -> FSDP2Config:
    """The config in force: ``given`` (the strategy's), else the module's ``fsdp2_config`` attribute (read by
    ``read``), else every parameter sharded at the root over all ranks (``sharding_size: auto``).

    A config in both places must be the same one: neither is silently dropped.
    """
    module_config = getattr(module, "fsdp2_config", None)
    if given is None:
        return read(module_config) if module_config is not None else FSDP2Config(sharding_size="auto")
    if module_config is not None and read(module_config) != given:
        raise ConfigError(
            "MMFSDP2Strategy was given an fsdp2_config and the LightningModule has a different one "
            f"({type(module).__name__}.fsdp2_config); give it in one place"
        )
    return given


def data_parallel_sampler_kwargs(mesh: DeviceMesh) -> dict[str, int]:
    """FSDP and HSDP are both data parallel over every rank: the sampler's rank is the flat index in the
    ``(shard,)`` or ``(replicate, shard)`` mesh."""
    if mesh.ndim == 1:
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}
    rank = mesh.get_local_rank("replicate") * mesh["shard"].size() + mesh.get_local_rank("shard")
    return {"num_replicas": mesh.size(), "rank": rank}


@dataclass(frozen=True)
class PlannedRun:
    """What :func:`plan_run` decides: the config with the model's defaults, the precision policy, the plan."""

    config: FSDP2Config
    """The config in force, the model's own defaults (``FSDP2Mixin.default_fsdp2_config``) merged in."""
    policy: PrecisionPolicy
    """The Trainer ``precision`` reconciled with the YAML dtypes."""
    plan: ShardingPlan
    """The sharding plan (pure data; what ``lightning-mm plan`` prints)."""
    target: nn.Module
    """The module the plan's paths are relative to (:func:`sharding_target`)."""


def plan_run(
    given: FSDP2Config | None,
    root: nn.Module,
    world_size: int,
    precision: str,
    keep_unsharded_for_backward: bool = True,
    read: ConfigReader = FSDP2Config.load,
) -> PlannedRun:
    """Decide a run of ``root`` (the LightningModule, or any module) on ``world_size`` ranks: no process, no torch
    collective; a meta-device model is enough. ``precision`` is the Trainer's (``"bf16-mixed"``, ...);
    ``keep_unsharded_for_backward``: see :attr:`ShardedRun.keep_unsharded_for_backward`; ``read``: see
    :func:`resolve_config`."""
    target = sharding_target(root)
    config = resolve_config(given, root, read).with_model_defaults(target)
    policy = resolve_precision_policy(config, precision)
    plan = build_plan(config, target, world_size, policy, keep_unsharded_for_backward)
    return PlannedRun(config, policy, plan, target)


class ShardedRun:
    """One run's config, plan and applied sharding (see the module docstring).

    Args:
        given: the config given to the strategy (``None``: the LightningModule's, or the default).
        read: reads the LightningModule's ``fsdp2_config`` attribute (see :func:`resolve_config`).
    """

    keep_unsharded_for_backward: bool = True
    """``False`` reshards the root and the last unit after forward like every other unit (no YAML key: the
    measurements of benchmarks/README.md compare the default against it)."""

    def __init__(self, given: FSDP2Config | None, read: ConfigReader = FSDP2Config.load) -> None:
        self.given = given
        """The config given to the strategy itself, as loaded (``None`` when it was given none)."""
        self.read = read
        """Reads the LightningModule's ``fsdp2_config`` attribute (:func:`resolve_config`)."""
        self.planned: PlannedRun | None = None
        """The decisions applied by :meth:`apply` (``None`` before)."""
        self.sharded: apply.ShardedModel | None = None
        """What applying the plan left: ignored modules, whole experts, norm groups, prefetch."""
        self.mesh: DeviceMesh | None = None
        """The FSDP2 device mesh of :meth:`build_mesh` (``None`` before)."""
        self.meshes: LayoutMeshes | None = None
        """The run's mesh builder (:meth:`build_mesh`; ``None`` before)."""
        self.gradient_sync = True
        """``False`` inside :meth:`no_gradient_sync` (the micro-batches of gradient accumulation but the last)."""
        self._expert_layout: ExpertCheckpointLayout | None = None

    def build_mesh(
        self, config: FSDP2Config, world_size: int, device_type: str, context_parallel_size: int | None = None
    ) -> DeviceMesh:
        """The run's FSDP2 mesh over ``world_size`` ranks: ``config``'s ``sharding_size`` (HSDP when it is smaller
        than the data-parallel ranks; the config in force, :meth:`config_for`) over the ranks that
        ``tensor_parallel_size`` leaves, on ``device_type`` devices; kept as :attr:`mesh`. The layout is checked
        here (:func:`~lightning_mm.core.parallel_layout.config_layout`; ``context_parallel_size``: the strategy's alias)
        and its mesh builder kept as :attr:`meshes`, which every feature takes its mesh from."""
        self.meshes = LayoutMeshes(config_layout(config, world_size, context_parallel_size), device_type)
        self.mesh = self.meshes.data_parallel
        return self.mesh

    def config_for(self, root: nn.Module | None) -> FSDP2Config:
        """The config in force for ``root`` before sharding (the processes need its ``sharding_size`` and
        ``offload_to_cpu``); after :meth:`apply`, the config the plan was built from."""
        if self.planned is not None:
            return self.planned.config
        return resolve_config(self.given, root, self.read)

    @property
    def plan(self) -> ShardingPlan:
        """The plan applied by :meth:`apply`."""
        if self.planned is None:
            raise StateError("The sharding plan is built in `setup()`; it is not available yet.")
        return self.planned.plan

    def apply(self, root: nn.Module, planned: PlannedRun, mesh: DeviceMesh, device: torch.device) -> None:
        """Apply a :func:`plan_run` decision to ``root`` on ``mesh`` (``apply.apply_plan``); ``device`` is the
        compute device. The model's own ``_fully_shard`` shards the units when it has one."""
        self.planned, self._expert_layout = planned, None
        check_parameters_fit(planned.target, planned.plan, device)  # before anything is materialised
        custom_units = apply.model_unit_sharding(planned.target, planned.config, planned.plan)
        meshes = self.meshes if self.meshes is not None and self.mesh is mesh else None
        self.sharded = apply.apply_plan(root, planned.target, planned.plan, mesh, device, custom_units, meshes)

    @property
    def norm_groups(self) -> dict[int, tuple[Any, ...]]:
        """``id(parameter)`` -> the further process groups its gradient-norm term is summed over (local experts)."""
        return self.sharded.norm_groups if self.sharded is not None else {}

    def reduce_unsharded_gradients(self) -> None:
        """After the last micro-batch's backward: average the gradients FSDP does not reduce (ignored modules,
        local experts kept whole)."""
        if self.sharded is not None:
            self.sharded.reduce_unsharded_gradients()

    def after_backward(self) -> None:
        """After each backward: :meth:`reduce_unsharded_gradients` unless inside :meth:`no_gradient_sync` (FSDP
        reduces the sharded parameters' gradients in its own backward hooks)."""
        if self.gradient_sync:
            self.reduce_unsharded_gradients()

    @contextmanager
    def no_gradient_sync(self, root: nn.Module) -> Generator[None, None, None]:
        """Gradient accumulation: no reduce-scatter (and no all-reduce of the unsharded gradients) until the last
        micro-batch. Nothing changes for a ``root`` that is not sharded yet."""
        if not isinstance(root, FSDPModule):
            yield
            return
        root.set_requires_gradient_sync(False)
        self.gradient_sync = False
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            self.gradient_sync = True

    def expert_view(self, root: nn.Module, kind: str) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
        """With expert parallelism, how checkpoints see the local experts (``kind``: ``"model"`` or
        ``"optimizer"``): as their share of the global, all-experts tensors, in both formats and directions (any
        ``expert_parallel_size`` reads any other). ``None`` without expert parallelism."""
        if self.planned is None or self.planned.plan.experts is None:
            return None
        if self._expert_layout is None:
            from lightning_mm.core import expert_parallel

            assert self.sharded is not None and self.sharded.ep_mesh is not None
            plan = self.planned.plan
            assert plan.experts is not None
            names = expert_parallel.expert_state_names(root, plan, self.planned.target)
            self._expert_layout = expert_parallel.ExpertCheckpointLayout(
                self.sharded.ep_mesh, plan.experts.num_experts, names
            )
        layout = self._expert_layout
        return layout.model_state if kind == "model" else layout.optimizer_state
