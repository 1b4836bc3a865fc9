"""Deciding the sharding: an FSDP2 config plus a (meta) model become a :class:`ShardingPlan`.

The plan is pure data. Building it resolves every pattern, checks the config against the model, and works out
which parameters each FSDP unit owns (grouping units that share a parameter), all without processes, so it can
be printed, tested and checked before any cluster time is spent. :mod:`lightning_mm.core.apply` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_mm._utils.modules import ROOT, enclosing, is_under_any, parameter_names_by_tensor
from lightning_mm._utils.modules import is_under as _is_under
from lightning_mm._utils.suggestions import listing
from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.core.norms import is_norm
from lightning_mm.core.parallel_layout import ParallelLayout, config_layout, data_parallel_mesh_layout, ep_mesh_layout
from lightning_mm.core.patterns import PatternError, resolve_patterns
from lightning_mm.core.precision_policy import PrecisionPolicy
from lightning_mm.core.recompute import RecomputeError, check_recomputable, uses_kv_cache
from lightning_mm.core.tensor_parallel import plan_tensor_parallel

__all__ = [
    "ShardUnit",
    "ShardingPlan",
    "ExpertPlan",
    "build_plan",
    "plan_in_use",
    "mesh_layout",
    "ep_mesh_layout",
    "norm_and_router_modules",
    "rank_shapes",
    "describe_rank_shapes",
]


mesh_layout = data_parallel_mesh_layout
"""Mesh shape and dimension names: ``(shard,)`` for FSDP, ``(replicate, shard)`` for HSDP (see
:mod:`lightning_mm.core.parallel_layout`)."""


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` call: usually one module, several when they share parameters (tied weights)."""

    modules: tuple[str, ...]
    """The module paths sharded by this call (from ``sub_modules_to_wrap``, or the ``align_fsdp_param_groups``
    modules); several only when they share parameters."""
    num_params: int
    """Parameters this unit owns (those of nested units, ignored modules and experts not counted)."""
    trainable_params: int | None = None
    """Of ``num_params``, those with ``requires_grad`` (``None``: not counted)."""
    label: str = ""
    """A short name for a unit of many modules (the aligned norm/router unit)."""
    keep_unsharded: bool = False
    """Parameters stay unsharded from forward to backward (the aligned unit: its modules run all through a step)."""

    @property
    def name(self) -> str:
        """The unit's name in logs: its label, or its modules joined by ``+``."""
        return self.label or " + ".join(self.modules)


@dataclass(frozen=True)
class ExpertPlan:
    """Expert parallelism: each MoE module's experts split over the ``ep`` ranks of an EP group."""

    expert_parallel_size: int
    """The config's ``expert_parallel_size``: ranks of one EP group, which together hold every expert."""
    moe_modules: tuple[str, ...]
    """The config's ``moe_modules``, resolved to module paths."""
    num_experts: int
    """Experts of each MoE module (all modules hold the same number)."""
    experts_per_rank: int
    """Experts each rank of an EP group holds (``num_experts / expert_parallel_size``)."""
    reshard_local_experts: bool
    """The config's ``reshard_local_experts``: FSDP-shard the local experts over ``ep_replicate`` (or keep them
    whole and all-reduce their gradients)."""
    expert_params: int
    """Expert parameters of all MoE modules (all experts, before splitting)."""
    expert_bytes: int
    """Bytes of the expert parameters of all MoE modules (before splitting)."""
    other_bytes: int
    """Bytes of every parameter that is not an expert's (before sharding)."""


@dataclass(frozen=True)
class ShardingPlan:
    """What the strategy will do to the model, in the order it does it."""

    world_size: int
    """Ranks of the run the plan is for."""
    sharding_size: int
    """The config's ``sharding_size`` resolved for ``world_size`` (``auto``: the world size): ranks per shard group."""
    units: tuple[ShardUnit, ...]
    """Sub-module units in application order (children before parents); the root unit comes after them. Built from
    the config's ``sub_modules_to_wrap`` (modules sharing parameters grouped) and ``align_fsdp_param_groups``."""
    root_params: int
    """Parameters the root unit owns: those in no unit, no ignored module and no MoE module."""
    ignored_modules: tuple[str, ...]
    """The config's ``ignored_modules``, resolved to module paths: kept whole on every rank, outside FSDP."""
    ignored_params: int
    """Parameters inside ``ignored_modules``."""
    recompute_modules: tuple[str, ...]
    """The config's ``recompute_modules``, resolved to module paths: activations recomputed in backward."""
    num_to_forward_prefetch: int
    """The config's ``num_to_forward_prefetch``: units gathered ahead in forward, in execution order."""
    num_to_backward_prefetch: int
    """The config's ``num_to_backward_prefetch``: units gathered ahead in backward (0: FSDP2's implicit one)."""
    precision: PrecisionPolicy
    """The resolved ``param_dtype``, ``reduce_dtype``, ``output_dtype`` and ``cast_forward_inputs`` (with the
    Trainer's precision)."""
    reshard_after_forward: bool
    """The config's ``reshard_after_forward``."""
    offload_to_cpu: bool
    """The config's ``offload_to_cpu``."""
    pin_memory: bool
    """The config's ``pin_memory``."""
    use_reentrant: bool
    """The config's ``use_reentrant`` (for ``recompute_modules``)."""
    notes: tuple[str, ...] = field(default=())
    """What the plan says about the config beyond its data (units grouped or dropped, settings not used)."""
    experts: ExpertPlan | None = None
    """Expert parallelism, or None without it (``expert_parallel_size: 1``)."""
    compile_modules: tuple[str, ...] = ()
    """Modules whose forward is compiled by ``torch.compile`` (one graph each), before recomputation and sharding."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend of ``compile_modules``."""
    keep_unsharded_for_backward: bool = True
    """The root and the last unit to run forward keep their parameters unsharded from forward to backward, whatever
    ``reshard_after_forward`` says: backward needs them first, so resharding them would only all-gather the same
    parameters again at once (two all-gathers per step saved; see benchmarks/README.md). The root is sharded so;
    the last unit is known once the first forward has run (``apply.ExecutionOrderPrefetch``)."""
    tensor_parallel_size: int = 1
    """The config's ``tensor_parallel_size``: FSDP2 shards over ``world_size / tensor_parallel_size`` ranks."""
    context_parallel_size: int = 1
    """The config's ``context_parallel_size`` (the strategy's argument of that name is applied by the strategy)."""
    tp_plan: tuple[tuple[str, str], ...] = ()
    """Module path -> tensor-parallel style (Transformers' notation), applied before ``fully_shard``."""
    encoder_dp_balance: bool = False
    """The config's ``encoder_dp_balance``: the vision tower's images dealt out over the ranks by estimated cost."""
    encoder_dp_balance_cost: tuple[float, float] | None = None
    """The config's ``encoder_dp_balance_cost`` (``None``: calibrated on the first tower calls)."""
    encoder_dp_balance_calibration_steps: int = 4
    """The config's ``encoder_dp_balance_calibration_steps``."""

    @property
    def layout(self) -> ParallelLayout:
        """The parallel layout the plan was checked against (:mod:`lightning_mm.core.parallel_layout`)."""
        ep = self.experts.expert_parallel_size if self.experts is not None else 1
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        return ParallelLayout(self.world_size, self.sharding_size, tp, cp, ep)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh's shape: ``(world_size,)``, or ``(replicate, shard)`` for HSDP."""
        return self.layout.world_mesh_shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The device mesh's dimension names: ``("shard",)`` or ``("replicate", "shard")``."""
        return self.layout.world_mesh_dim_names

    @property
    def is_hsdp(self) -> bool:
        """Whether parameters are sharded within groups and replicated across them (``sharding_size`` < world)."""
        return self.layout.dp_replicate > 1

    @property
    def unit_modules(self) -> tuple[str, ...]:
        """Every module path of every unit, in unit order."""
        return tuple(m for unit in self.units for m in unit.modules)

    def is_ignored(self, path: str) -> bool:
        """Whether the module or parameter at ``path`` is inside an ``ignored_modules`` module (whole on every rank)."""
        return is_under_any(path, self.ignored_modules)

    def describe(self) -> str:
        """A readable summary: mesh, units with their parameter counts, ignored and recomputed modules."""

        def dt(d: torch.dtype | None) -> str:
            return str(d).removeprefix("torch.") if d is not None else "model dtype"

        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        kind = "HSDP" if self.is_hsdp else "FSDP"
        root_kept = _KEPT if self.reshard_after_forward and self.keep_unsharded_for_backward else ""
        lines = [
            f"FSDP2 sharding plan: {kind}, world size {self.world_size}, mesh ({mesh})",
            f"  precision: param {dt(self.precision.param_dtype)}, reduce {dt(self.precision.reduce_dtype)}, "
            f"output {dt(self.precision.output_dtype)}, cast_forward_inputs={self.precision.cast_forward_inputs}",
            f"  reshard_after_forward={self.reshard_after_forward}{root_kept}"
            f", offload_to_cpu={self.offload_to_cpu}{', pin_memory' if self.pin_memory else ''}",
            f"  units ({len(self.units)} + root, in wrapping order):",
        ]
        for u in self.units:
            lines.append(f"    {u.name:<60} {u.num_params:>14,} params{_split(u)}")
            if u.label:
                shown = listing(u.modules, 6)
                kept = "; kept unsharded from forward to backward" if u.keep_unsharded else ""
                lines.append(f"      = {shown}{kept}")
        lines.append(f"    {'<root>':<60} {self.root_params:>14,} params")
        lines.append(
            f"  ignored ({self.ignored_params:,} params, whole on every rank, trainable ones' gradients all-reduced): "
            f"{', '.join(self.ignored_modules) or '-'}"
        )
        reentrant = "reentrant" if self.use_reentrant else "non-reentrant"
        lines.append(f"  recomputed ({reentrant}): {', '.join(self.recompute_modules) or '-'}")
        lines.append(f"  encoder_dp_balance: {self._describe_balance()}")
        if self.compile_modules:
            lines.append(
                f"  compiled (torch.compile, backend {self.compile_backend}, one graph each; the rest "
                f"eager): {listing(self.compile_modules, 8)}"
            )
        backward = (
            str(self.num_to_backward_prefetch) if self.num_to_backward_prefetch else "FSDP2 default (1, implicit)"
        )
        lines.append(
            f"  prefetch: forward {self.num_to_forward_prefetch}, backward {backward} "
            "(units in execution order, taken from the first forward pass)"
        )
        if self.experts is not None:
            lines += self._describe_experts()
        if self.tp_plan:
            lines.append(f"  {self.layout.describe()}")
            styles = ", ".join(f"{p}: {s}" for p, s in self.tp_plan[:6]) + (" ..." if len(self.tp_plan) > 6 else "")
            lines.append(f"  tensor parallel ({len(self.tp_plan)} modules, before fully_shard): {styles}")
        lines += [f"  note: {n}" for n in self.notes]
        if self.sharding_size == 1 and self.world_size > 1:
            lines.append(
                "  note: sharding_size 1 (MindSpeed MM's default): parameters are replicated, not sharded; "
                "set `sharding_size: auto` to shard over all ranks"
            )
        return "\n".join(lines)

    @property
    def ep_mesh_shape(self) -> tuple[int, int] | None:
        """The expert mesh's ``(ep_replicate, ep)`` shape, or ``None`` without expert parallelism."""
        return None if self.experts is None else ep_mesh_layout(self.world_size, self.experts.expert_parallel_size)[0]

    def bytes_per_rank(self) -> tuple[int, int]:
        """Parameter bytes one rank holds: ``(non-expert, expert)`` (FSDP shards rounded up)."""
        ep = self.experts
        assert ep is not None
        replicate = self.world_size // ep.expert_parallel_size
        expert = -(-ep.expert_bytes // ep.expert_parallel_size)
        if ep.reshard_local_experts:
            expert = -(-expert // replicate)
        return -(-ep.other_bytes // self.sharding_size), expert

    def _describe_balance(self) -> str:
        if not self.encoder_dp_balance:
            return "off (each rank encodes its own images)"
        if self.encoder_dp_balance_cost is None:
            how = f"calibrated on the first {self.encoder_dp_balance_calibration_steps} tower calls"
        else:
            linear, quadratic = self.encoder_dp_balance_cost
            how = f"{linear:g} * patches + {quadratic:g} * attention"
        return f"on (the vision tower's images dealt out over the ranks by estimated cost: {how})"

    def _describe_experts(self) -> list[str]:
        ep = self.experts
        assert ep is not None
        shape, names = ep_mesh_layout(self.world_size, ep.expert_parallel_size)
        mesh = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
        local = (
            "FSDP-sharded over ep_replicate"
            if ep.reshard_local_experts
            else "kept whole, gradients all-reduced over ep_replicate"
        )
        other, expert = self.bytes_per_rank()
        no_ep = -(-(ep.other_bytes + ep.expert_bytes) // self.sharding_size)
        return [
            f"  expert parallel: mesh ({mesh}), {len(ep.moe_modules)} MoE module(s), {ep.num_experts} experts each, "
            f"{ep.experts_per_rank} per rank; local experts {local}",
            f"    moe_modules: {', '.join(ep.moe_modules)}",
            f"    parameter bytes per rank: {other + expert:,} ({other:,} non-expert + {expert:,} expert; "
            f"{no_ep:,} without expert parallelism)",
        ]


def rank_shapes(target: nn.Module, plan: ShardingPlan) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(name, whole shape, shape on one rank)`` of every parameter of ``target`` under ``plan``: split over the
    ``tp`` ranks by its module's style (``colwise``: rows, ``rowwise``: columns of a weight), then its rows over
    FSDP2's shard group (rank 0's share, rounded up); local experts split over ``ep`` first; ignored modules whole.
    Layers that differ only by their index are listed once (``layers.*``)."""
    styles = dict(plan.tp_plan)
    ep = plan.experts
    experts = set(ep.moe_modules) if ep is not None else set()
    seen: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
    for name, param in target.named_parameters():
        module, _, leaf = name.rpartition(".")
        shape = list(param.shape)
        style = styles.get(module)
        if style == "colwise" and shape:
            shape[0] = -(-shape[0] // plan.tensor_parallel_size)
        elif style == "rowwise" and len(shape) == 2 and leaf == "weight":
            shape[1] = -(-shape[1] // plan.tensor_parallel_size)
        shard = plan.sharding_size
        if ep is not None and is_under_any(name, tuple(experts)) and shape:
            shape[0] //= ep.expert_parallel_size
            shard = plan.world_size // ep.expert_parallel_size if ep.reshard_local_experts else 1
        if not plan.is_ignored(name) and shape:
            shape[0] = -(-shape[0] // shard)
        key = ".".join("*" if part.isdigit() else part for part in name.split("."))
        seen.setdefault(key, (key, tuple(param.shape), tuple(shape)))
    return list(seen.values())


def describe_rank_shapes(target: nn.Module, plan: ShardingPlan, limit: int = 40) -> str:
    """:func:`rank_shapes` as lines (at most ``limit``)."""
    rows = rank_shapes(target, plan)
    lines = [f"  per-rank parameter shapes ({plan.layout.describe()}):"]
    for key, whole, local in rows[:limit]:
        lines.append(f"    {key:<60} {str(list(whole)):>14} -> {list(local)}")
    if len(rows) > limit:
        lines.append(f"    ... {len(rows) - limit} more")
    return "\n".join(lines)


def _split(unit: ShardUnit) -> str:
    """`` (N trainable, M frozen)`` for a unit with frozen parameters (LoRA, ``freeze``), else nothing."""
    if unit.trainable_params is None or unit.trainable_params == unit.num_params:
        return ""
    return f" ({unit.trainable_params:,} trainable, {unit.num_params - unit.trainable_params:,} frozen)"


# ShardingPlan.keep_unsharded_for_backward: these two stay unsharded between their forward and their backward.
_KEPT = " (except the root and the last unit to run: backward needs them first)"


def _owner(path: str, candidates: list[str]) -> str:
    """The deepest candidate module that contains ``path`` (``ROOT`` if none)."""
    best = ROOT
    for candidate in candidates:
        if _is_under(path, candidate) and len(candidate) > len(best):
            best = candidate
    return best


def _module_of(param_path: str) -> str:
    return param_path.rpartition(".")[0]


def _resolve(model: nn.Module, config: FSDP2Config, key: str) -> list[str]:
    try:
        return resolve_patterns(model, getattr(config, key), key)
    except PatternError as err:
        raise config.key_error(None, str(err)) from None


def _check_overlaps(wrapped: list[str], ignored: list[str], config: FSDP2Config) -> None:
    for unit in wrapped:
        ign = enclosing(unit, ignored)
        if ign is not None:
            raise config.key_error(
                None,
                f"`sub_modules_to_wrap` module '{unit}' is inside `ignored_modules` "
                f"module '{ign}'; a module cannot be both sharded and ignored",
            )


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def _group_shared_parameters(
    model: nn.Module, wrapped: list[str], ignored: list[str], config: FSDP2Config
) -> tuple[list[tuple[str, ...]], list[str]]:
    """Group units that own the same parameter object; a unit nested in its partner dissolves into it."""
    shared: list[list[str]] = []
    for paths in parameter_names_by_tensor(model).values():
        in_ignored = [is_under_any(p, ignored) for p in paths]
        if any(in_ignored) and not all(in_ignored):
            raise config.key_error(
                None,
                f"parameter shared by {sorted(paths)} is partly in `ignored_modules`; "
                "ignore every module that uses it or none",
            )
        if len(paths) > 1 and not any(in_ignored):
            shared.append(paths)

    notes: list[str] = []
    units = list(wrapped)
    changed = True
    while changed:  # dropping a unit can change the owners of other shared parameters
        changed = False
        for paths in shared:
            owners = {_owner(_module_of(p), units) for p in paths}
            for inner in sorted(owners):
                outer = next((o for o in owners if o != inner and _is_under(inner, o)), None)
                if outer is not None and inner in units:
                    units.remove(inner)
                    enclosing = "the root" if outer == ROOT else repr(outer)
                    notes.append(
                        f"'{inner}' shares parameters ({', '.join(sorted(paths))}) with {enclosing}; "
                        "not wrapped as a unit of its own"
                    )
                    changed = True

    uf = _UnionFind()
    for paths in shared:
        ordered = sorted({_owner(_module_of(p), units) for p in paths})
        for other in ordered[1:]:
            uf.union(ordered[0], other)
    groups: dict[str, list[str]] = {}
    for unit in units:
        groups.setdefault(uf.find(unit), []).append(unit)
    result = []
    for members in groups.values():
        if len(members) > 1:
            notes.append(f"grouped {', '.join(members)} into one FSDP unit: they share parameters (tied weights)")
        result.append(tuple(members))
    return result, notes


def _is_router(path: str, module: nn.Module, model: nn.Module) -> bool:
    if "Router" in type(module).__name__:
        return True
    parent, _, leaf = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    return leaf in ("gate", "router") and hasattr(owner, "experts")  # the MoE block's gate beside its experts


def norm_and_router_modules(model: nn.Module, units: list[str], ignored: list[str]) -> list[str]:
    """The modules ``align_fsdp_param_groups`` gathers into one unit, found by type, not by path.

    Norms and MoE routers strictly inside the wrapped units (input/post-attention norms, q/k norms, the MoE
    gate), and the norms beside a stack of wrapped blocks (the final norm of a decoder) that would otherwise stay
    in the root unit. Outermost matches only; modules without parameters of their own are skipped.
    """
    stacks = set()
    for unit in units:
        parent = unit.rpartition(".")[0]
        container = model.get_submodule(parent) if parent else model
        if isinstance(container, nn.ModuleList):
            stacks.add(parent.rpartition(".")[0])
    found: list[str] = []
    for path, module in model.named_modules():
        if not path or is_under_any(path, found) or is_under_any(path, ignored):
            continue
        if not any(True for _ in module.parameters()):
            continue
        if not (is_norm(module) or _is_router(path, module, model)):
            continue
        owner = _owner(path, units)
        inside = owner != ROOT and owner != path
        beside_stack = owner == ROOT and path not in units and path.rpartition(".")[0] in stacks
        if inside or beside_stack:
            found.append(path)
    return found


def _num_experts(path: str, module: nn.Module, config: FSDP2Config) -> int:
    """Experts of a MoE module: its ``num_experts`` or the common first dimension of its (3-D) weights."""
    declared = getattr(module, "num_experts", None)
    if isinstance(declared, int) and not isinstance(declared, bool):
        return declared
    firsts = {p.shape[0] for p in module.parameters() if p.ndim >= 2}
    if len(firsts) != 1:
        raise config.key_error(
            "moe_modules",
            f"cannot tell how many experts '{path}' holds: it has no `num_experts` "
            "and its weights do not share a leading experts dimension",
        )
    return firsts.pop()


def _plan_experts(
    model: nn.Module, config: FSDP2Config, world_size: int, wrapped: list[str], ignored: list[str]
) -> ExpertPlan:
    size = config.expert_parallel_size
    config.check_expert_parallel_size(world_size)
    if not config.moe_modules:
        raise config.key_error(
            "moe_modules",
            f"`expert_parallel_size: {size}` needs the MoE expert modules (e.g. `model.layers.{{*}}.mlp.experts`)",
        )
    modules = _resolve(model, config, "moe_modules")
    counts = set()
    for path in modules:
        if path in wrapped:
            raise config.key_error(
                "moe_modules",
                f"'{path}' is also in `sub_modules_to_wrap`; expert modules are "
                "sharded by expert parallelism, not as units of their own",
            )
        if is_under_any(path, ignored):
            raise config.key_error("moe_modules", f"'{path}' is inside `ignored_modules`")
        if any(_is_under(other, path) for other in modules if other != path):
            raise config.key_error("moe_modules", f"'{path}' contains another MoE module")
        module = model.get_submodule(path)
        if not any(True for _ in module.parameters()):
            raise config.key_error("moe_modules", f"'{path}' has no parameters")
        experts = _num_experts(path, module, config)
        if experts % size:
            raise config.key_error("expert_parallel_size", f"{size} does not divide the {experts} experts of '{path}'")
        counts.add(experts)
    if len(counts) != 1:
        raise config.key_error("moe_modules", f"the MoE modules hold different numbers of experts: {sorted(counts)}")
    experts = counts.pop()
    expert_ids = {id(p) for path in modules for p in model.get_submodule(path).parameters()}
    expert_numel = expert_bytes = other_bytes = 0
    for _, param in model.named_parameters():
        if id(param) in expert_ids:
            expert_numel += param.numel()
            expert_bytes += param.numel() * param.element_size()
        else:
            other_bytes += param.numel() * param.element_size()
    return ExpertPlan(
        expert_parallel_size=size,
        moe_modules=tuple(modules),
        num_experts=experts,
        experts_per_rank=experts // size,
        reshard_local_experts=config.reshard_local_experts,
        expert_params=expert_numel,
        expert_bytes=expert_bytes,
        other_bytes=other_bytes,
    )


def _count_params(
    model: nn.Module, groups: list[tuple[str, ...]], ignored: list[str], experts: tuple[str, ...] = ()
) -> tuple[list[int], int, int, list[int]]:
    unit_of = {m: i for i, group in enumerate(groups) for m in group}
    flat = list(unit_of)
    counts = [0] * len(groups)
    trainable = [0] * len(groups)
    root = ignored_count = 0
    for path, param in model.named_parameters():  # each parameter object once
        if is_under_any(path, experts):
            continue
        if is_under_any(path, ignored):
            ignored_count += param.numel()
            continue
        owner = _owner(_module_of(path), flat)
        if owner == ROOT:
            root += param.numel()
        else:
            counts[unit_of[owner]] += param.numel()
            trainable[unit_of[owner]] += param.numel() if param.requires_grad else 0
    return counts, root, ignored_count, trainable


def _aligned_group(
    model: nn.Module, config: FSDP2Config, groups: list[tuple[str, ...]], ignored: list[str]
) -> tuple[str, ...]:
    """``align_fsdp_param_groups``: the norms and routers inside the wrapped units, as one unit (empty when off)."""
    if not config.align_fsdp_param_groups:
        return ()
    aligned = tuple(norm_and_router_modules(model, [m for g in groups for m in g], ignored))
    if not aligned:
        raise config.key_error(
            "align_fsdp_param_groups",
            "found no norm or router module inside the wrapped units "
            "(`sub_modules_to_wrap`) to gather into a unit of its own",
        )
    return aligned


def _setting_notes(model: nn.Module, config: FSDP2Config, recompute: list[str]) -> list[str]:
    """What the plan says about settings that take effect differently than one might expect."""
    notes = []
    if config.expert_parallel_size == 1 and config.moe_modules and "moe_modules" in config.explicit_keys:
        notes.append(
            "`moe_modules` is not used with `expert_parallel_size: 1` (the experts are sharded like the "
            "rest of their unit)"
        )
    if recompute and uses_kv_cache(model):
        notes.append(
            "recomputed modules run without the key/value cache (`use_cache`) when gradients are on: "
            "a replay in backward would update it a second time"
        )
    return notes


def _check_compiled(
    compiled: list[str], groups: list[tuple[str, ...]], experts: ExpertPlan | None, config: FSDP2Config
) -> None:
    """A compiled module must not hold other FSDP units (their hooks would run inside its graph) or experts
    split by expert parallelism (their dispatch communicates), and must not sit inside another compiled one."""
    for path in compiled:
        inner = [m for g in groups for m in g if m != path and _is_under(m, path)]
        if inner:
            raise config.key_error(
                "compile_modules",
                f"'{path}' holds FSDP units ({listing(inner, 3)}) whose "
                "all-gathers would run inside its graph; compile the units (or modules inside them) instead",
            )
        nested = [other for other in compiled if other != path and _is_under(path, other)]
        if nested:
            raise config.key_error(
                "compile_modules", f"'{path}' is inside '{nested[0]}', which is compiled too; list one of them"
            )
        moe = [m for m in (experts.moe_modules if experts is not None else ()) if _is_under(m, path)]
        if moe:
            raise config.key_error(
                "compile_modules",
                f"'{path}' holds expert-parallel modules "
                f"({listing(moe, 3)}) whose token dispatch communicates; compile modules without them",
            )


_IN_USE: ContextVar[tuple[FSDP2Config, nn.Module, ShardingPlan] | None] = ContextVar("plan_in_use", default=None)


@contextlib.contextmanager
def plan_in_use(config: FSDP2Config, model: nn.Module, plan: ShardingPlan) -> Iterator[None]:
    """While ``plan`` (built from ``config`` for ``model``) is applied, :func:`build_plan` for the same config object
    and model returns it instead of resolving the config's patterns again.

    A model's own ``_fully_shard(fsdp2_kwargs, fsdp2_config)`` that plans its units itself (``FSDP2Mixin``'s,
    through ``super()``) gets the plan being applied: the user's patterns are resolved once per run.
    """
    token = _IN_USE.set((config, model, plan))
    try:
        yield
    finally:
        _IN_USE.reset(token)


def _plan_in_use(
    config: FSDP2Config, model: nn.Module, world_size: int, precision: PrecisionPolicy | None, keep: bool
) -> ShardingPlan | None:
    in_use = _IN_USE.get()
    if in_use is None or in_use[0] is not config or in_use[1] is not model:
        return None
    plan = in_use[2]
    same = plan.world_size == world_size and keep == plan.keep_unsharded_for_backward
    return plan if same and (precision is None or precision == plan.precision) else None


def build_plan(
    config: FSDP2Config,
    model: nn.Module,
    world_size: int,
    precision: PrecisionPolicy | None = None,
    keep_unsharded_for_backward: bool = True,
) -> ShardingPlan:
    """Resolve ``config`` against ``model`` for ``world_size`` ranks; every problem is a clear error here.

    ``keep_unsharded_for_backward=False`` reshards the root and the last unit after forward like every other unit
    (no YAML key: the measurements of benchmarks/README.md compare against it). Each pattern key is resolved once
    here; inside :func:`plan_in_use` the plan being applied is returned for its own config and model.
    """
    in_use = _plan_in_use(config, model, world_size, precision, keep_unsharded_for_backward)
    if in_use is not None:  # the plan being applied (plan_in_use): resolved once
        return in_use
    layout = config_layout(config, world_size)
    wrapped = _resolve(model, config, "sub_modules_to_wrap")
    ignored = _resolve(model, config, "ignored_modules")
    recompute = _resolve(model, config, "recompute_modules")
    _check_overlaps(wrapped, ignored, config)
    try:
        check_recomputable(model, recompute, config.source)
    except RecomputeError as err:
        raise FSDP2ConfigError(str(err)) from None

    groups, notes = _group_shared_parameters(model, wrapped, ignored, config)
    aligned = _aligned_group(model, config, groups, ignored)
    if aligned:
        groups.append(aligned)
    experts = _plan_experts(model, config, world_size, wrapped, ignored) if config.expert_parallel_size > 1 else None
    notes += _setting_notes(model, config, recompute)
    compiled = _resolve(model, config, "compile_modules")
    _check_compiled(compiled, groups, experts, config)
    tp_plan = plan_tensor_parallel(config, model, layout, experts.moe_modules if experts is not None else ())
    # Children before parents: a parent's fully_shard must see its children already sharded.
    groups.sort(key=lambda g: -max(m.count(".") + 1 for m in g))
    counts, root_params, ignored_params, trainable = _count_params(
        model, groups, ignored, experts.moe_modules if experts is not None else ()
    )
    if precision is None:
        precision = PrecisionPolicy.from_config(config)
    cost = config.encoder_dp_balance_cost
    return ShardingPlan(
        world_size=world_size,
        sharding_size=layout.dp_shard,
        units=tuple(
            ShardUnit(g, n, t, f"<norms and routers: {len(g)} modules>", True) if g == aligned else ShardUnit(g, n, t)
            for g, n, t in zip(groups, counts, trainable)
        ),
        root_params=root_params,
        ignored_modules=tuple(ignored),
        ignored_params=ignored_params,
        recompute_modules=tuple(recompute),
        num_to_forward_prefetch=config.num_to_forward_prefetch,
        num_to_backward_prefetch=config.num_to_backward_prefetch,
        precision=precision,
        reshard_after_forward=config.reshard_after_forward,
        offload_to_cpu=config.offload_to_cpu,
        pin_memory=config.pin_memory,
        use_reentrant=config.use_reentrant,
        notes=tuple(notes),
        experts=experts,
        compile_modules=tuple(compiled),
        compile_backend=config.compile_backend,
        keep_unsharded_for_backward=keep_unsharded_for_backward,
        tensor_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        tp_plan=tp_plan,
        encoder_dp_balance=config.encoder_dp_balance,
        encoder_dp_balance_cost=None if cost is None else (float(cost[0]), float(cost[1])),
        encoder_dp_balance_calibration_steps=config.encoder_dp_balance_calibration_steps,
    )
