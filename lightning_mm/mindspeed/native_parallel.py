"""MindSpeed MM's native FSDP2 route: its ``parallel:`` section as this project's :class:`FSDP2Config` keys.

MindSpeed MM's recommended FSDP2 route (``mindspeed_mm/fsdp/train/trainer.py``) reads one YAML with six sections,
``parallel``, ``model``, ``data``, ``features``, ``training`` and ``tools`` (its dataclasses in
``mindspeed_mm/fsdp/params/*.py``). The sharding part of it, ``parallel`` (``ParallelArguments``) plus the
recompute switch and plan that its ``features`` section may carry too, maps onto the 18-key FSDP2 config:

* ``fully_shard_parallel_size`` -> ``sharding_size`` (``auto``: all ranks; a divisor: HSDP, replicas of that size)
* ``fsdp_plan.apply_modules`` / ``ignored_modules`` -> ``sub_modules_to_wrap`` / ``ignored_modules`` (same
  pattern syntax, ``layers.{*}``); ``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``,
  ``reshard_after_forward``, ``num_to_forward_prefetch``, ``num_to_backward_prefetch`` -> the same keys;
  ``cpu_offload`` -> ``offload_to_cpu``
* ``expert_parallel_size`` / ``ep_plan.apply_modules`` -> ``expert_parallel_size`` / ``moe_modules``;
  ``expert_fully_shard_parallel_size`` 1 -> ``reshard_local_experts: false`` (otherwise ``true``: the local experts
  are sharded over the ranks that hold the same experts, MindSpeed MM's default ``world / expert_parallel_size``)
* ``recompute`` + ``recompute_plan.apply_modules`` (in ``parallel`` or ``features``) -> ``recompute_modules``;
  ``recompute_plan.use_reentrant`` -> ``use_reentrant``
* ``tensor_parallel_size`` / ``tp_plan.colwise_parallel`` + ``rowwise_parallel`` -> ``tensor_parallel_size`` /
  ``tp_plan`` (Transformers' notation: pattern -> ``colwise`` / ``rowwise``, ``{*}`` -> ``*``); MindSpeed MM itself
  rejects sizes above 1, here they run (what tensor parallelism does not compose with is refused when the model is
  set up, by name)
* ``ulysses_parallel_size`` -> ``context_parallel_size`` (Ulysses context parallelism; the strategy argument of
  the same name is its alias)
* ``ring_attention_size`` -> ``context_parallel_size`` with ``context_parallel_algo: kv_allgather`` (ring
  attention's zig-zag layout and results; keys and values all-gathered; NPU-only in MindSpeed MM, any device here)

MindSpeed MM's defaults are kept where they differ from this project's: ``fully_shard_parallel_size: auto``,
``num_to_backward_prefetch: 0``, ``use_reentrant: false`` and ``ignored_modules: []`` (nothing ignored; this
project's default would ignore a fully frozen vision tower: :mod:`lightning_mm.mindspeed.ignored_default`) are
written when the section leaves them out.
Keys that change what is computed and that this project cannot honour (``tp_plan.sequence_parallel``;
``ring_attention_size`` together with ``ulysses_parallel_size``; a fixed ``data_parallel_size``...) are
``refused``; keys that only tune speed or NPU kernels and have no counterpart (``pregather``, ``hook_modules``,
``ep_plan.dispatcher``...) are ``without_effect``. Both lists carry the reason. Nothing is dropped silently.

Pure: no Lightning, no Transformers, no processes.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_mm._utils.suggestions import find_unknown_key
from lightning_mm._utils.yaml_io import short_repr
from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.mindspeed.keys import KeyReader

__all__ = [
    "NATIVE_SECTIONS",
    "PARALLEL_KEYS",
    "NativeParallel",
    "native_layout",
    "map_parallel",
    "fsdp2_config_from_native",
]

NATIVE_SECTIONS = ("parallel", "model", "data", "features", "training", "tools")
"""The top-level sections of a native-route config (``mindspeed_mm/fsdp/params/argument.py``)."""

PARALLEL_KEYS = (
    "data_parallel_size",
    "fully_shard_parallel_size",
    "fsdp_plan",
    "tensor_parallel_size",
    "tp_plan",
    "ring_attention_size",
    "ulysses_parallel_size",
    "expert_parallel_size",
    "expert_fully_shard_parallel_size",
    "ep_plan",
    "recompute",
    "recompute_plan",
)
"""``ParallelArguments``' fields."""
FSDP_PLAN_KEYS = (
    "ignored_modules",
    "apply_modules",
    "param_dtype",
    "reduce_dtype",
    "output_dtype",
    "cast_forward_inputs",
    "reshard_after_forward",
    "num_to_forward_prefetch",
    "num_to_backward_prefetch",
    "pregather",
    "hook_modules",
    "cpu_offload",
)
EP_PLAN_KEYS = ("apply_modules", "use_npu_fused_ops", "dispatcher", "apply_efsdp_modules", "_gradient_divide_factor")
TP_PLAN_KEYS = ("colwise_parallel", "rowwise_parallel", "sequence_parallel")
RECOMPUTE_PLAN_KEYS = ("apply_modules", "use_reentrant")

# Keys of the parallel section that exist only in MindSpeed MM's native layout (expert_parallel_size,
# tensor_parallel_size and tp_plan are also FSDP2 config keys): one of them at the top level of a mapping makes it a
# parallel section.
_NATIVE_ONLY = frozenset(PARALLEL_KEYS) - {"expert_parallel_size", "tensor_parallel_size", "tp_plan"}

_SAME = (
    "param_dtype",
    "reduce_dtype",
    "output_dtype",
    "cast_forward_inputs",
    "reshard_after_forward",
    "num_to_forward_prefetch",
    "num_to_backward_prefetch",
)
_WITHOUT_EFFECT = {
    "fsdp_plan.pregather": "MindSpeed MM all-gathers every unit's parameters once before the first step (speed "
    "only); here each unit is gathered when it runs, prefetched per num_to_*_prefetch",
    "fsdp_plan.hook_modules": "MindSpeed MM's hook manager moves each unit's FSDP hooks to other modules (speed "
    "only); here the hooks stay on the units",
    "ep_plan.use_npu_fused_ops": "MindSpeed MM's fused NPU expert kernels; the experts here run Transformers' code",
}
_DISPATCHERS = {
    "alltoall": None,
    "allgather": "tokens are exchanged with all-to-all here (same result as MindSpeed MM's allgather)",
    "mc2": "MindSpeed MM's fused NPU dispatch; tokens are exchanged with all-to-all here (same result)",
}


@dataclass
class NativeParallel:
    """What became of each key of a native ``parallel:`` section (and the recompute keys of ``features:``)."""

    fsdp2: dict[str, Any] = field(default_factory=dict)
    """The FSDP2 config keys (:class:`~lightning_mm.core.config.FSDP2Config`)."""
    mapped: list[str] = field(default_factory=list)
    without_effect: list[str] = field(default_factory=list)
    """Keys with no counterpart that do not change what is computed, each with the reason."""
    refused: list[str] = field(default_factory=list)
    """Keys that change what is computed and cannot be honoured here, each with the reason."""


def native_layout(data: Any) -> str | None:
    """``"config"`` for a whole native config (a ``parallel:`` mapping at the top), ``"parallel"`` for the section
    itself (a key only ``ParallelArguments`` has: ``fsdp_plan``, ``fully_shard_parallel_size``...), else None."""
    if not isinstance(data, Mapping):
        return None
    if isinstance(data.get("parallel"), Mapping):
        return "config"
    if any(isinstance(k, str) and k in _NATIVE_ONLY for k in data):
        return "parallel"
    return None


class _Reader(KeyReader):
    """The key reader of a native ``parallel:`` section; unknown keys are errors, or collected in ``unknown_keys``
    (``lightning-mm migrate`` reports them)."""

    def __init__(self, prefix: str, source: str | None, error: type[Exception], unknown: list[str] | None) -> None:
        super().__init__(source, prefix, error, "native FSDP2 config key `{key}`{in_source}")
        self.unknown_keys = unknown

    def section(self, data: Any, key: str, known: tuple[str, ...]) -> dict[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            raise self.fail(key, f"expected a mapping, got {short_repr(data)}")
        prefix = f"{self.prefix}{key}." if key else self.prefix
        section = {}
        for name, value in data.items():
            unknown = find_unknown_key([name], known, prefix)
            if unknown is None:
                section[name] = value
                continue
            shown, hint = unknown
            if self.unknown_keys is None:
                where = f" in {self.source}" if self.source else ""
                raise self.error(
                    f"unknown native FSDP2 config key `{shown}`{where}{hint} (MindSpeed MM accepts an "
                    "unknown key and nothing reads it; remove it)"
                )
            self.unknown_keys.append(
                f"{shown}: not a key of MindSpeed MM's parallel arguments{hint}; MindSpeed MM accepts "
                "it as an extra field and nothing reads it"
            )
        return section

    def patterns(self, value: Any, key: str) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
            raise self.fail(key, f"expected a list of module path strings, got {short_repr(value)}")
        return [v.strip() for v in value]


def map_parallel(
    parallel: Any,
    features: Any = None,
    source: str | None = None,
    prefix: str = "parallel.",
    error: type[Exception] | None = None,
    strict: bool = True,
) -> NativeParallel:
    """Map a native ``parallel:`` section (and ``features.recompute`` / ``features.recompute_plan``, which
    MindSpeed MM's feature pass reads too) onto FSDP2 config keys.

    An unknown key (with the nearest valid one) or a malformed value raises ``error`` (default ``ValueError``;
    ``FSDP2Config`` passes its ``FSDP2ConfigError``) naming the key and ``source``; keys that cannot be honoured
    are listed in the result (``refused``, ``without_effect``), never dropped. ``strict=False`` (``lightning-mm
    migrate``) lists an unknown key in ``without_effect`` instead (MindSpeed MM accepts it and nothing reads it).
    """
    if error is None:
        error = ValueError
    out = NativeParallel()
    read = _Reader(prefix, source, error, None if strict else out.without_effect)
    if not isinstance(parallel, Mapping):
        raise read.error(
            f"the native `parallel` section{f' in {source}' if source else ''} must be a mapping, got "
            f"{short_repr(parallel)}"
        )
    section = read.section(parallel, "", PARALLEL_KEYS) if parallel else {}
    _map_sizes(section, prefix, read, out)
    _map_fsdp_plan(section, prefix, read, out)
    _map_experts(section, prefix, read, out)
    # recompute (MindSpeed MM reads it from parallel and from features)
    _map_recompute(section, prefix, read, out)
    if isinstance(features, Mapping):
        read.prefix = "features."
        _map_recompute(
            {k: features[k] for k in ("recompute", "recompute_plan") if k in features}, "features.", read, out
        )
        read.prefix = prefix
    if "use_reentrant" not in out.fsdp2:
        out.fsdp2["use_reentrant"] = False  # MindSpeed MM's RecomputePlanConfig default
    return out


def _map_sizes(section: Mapping[str, Any], prefix: str, read: _Reader, out: NativeParallel) -> None:
    """The sizes: ``fully_shard_parallel_size``, ``data_parallel_size``, tensor, ring and Ulysses sizes."""
    fsdp2 = out.fsdp2

    def mapped(key: str, target: str) -> None:
        out.mapped.append(f"{prefix}{key} -> {target}")

    size = section.get("fully_shard_parallel_size", "auto")
    if isinstance(size, str) and size.strip().lower() == "auto":
        fsdp2["sharding_size"] = "auto"
    else:
        fsdp2["sharding_size"] = read.int_at_least(size, "fully_shard_parallel_size")
    mapped(
        "fully_shard_parallel_size" + ("" if "fully_shard_parallel_size" in section else " (default auto)"),
        f"fsdp2_config.sharding_size: {fsdp2['sharding_size']}",
    )
    dp = section.get("data_parallel_size")
    if dp is not None:
        read.int_at_least(dp, "data_parallel_size")
        out.refused.append(
            f"{prefix}data_parallel_size: {dp}: derived here from the world size (world / "
            "context_parallel_size), as MindSpeed MM checks it must be; remove it"
        )
    elif "data_parallel_size" in section:
        mapped("data_parallel_size: null", "derived from the world size, as in MindSpeed MM")
    tp = read.int_at_least(section.get("tensor_parallel_size", 1), "tensor_parallel_size")
    if tp > 1 or "tensor_parallel_size" in section:
        fsdp2["tensor_parallel_size"] = tp
        mapped("tensor_parallel_size", f"fsdp2_config.tensor_parallel_size: {tp}")
    _map_tp_plan(read.section(section.get("tp_plan"), "tp_plan", TP_PLAN_KEYS), tp, prefix, read, out)
    ring = read.int_at_least(section.get("ring_attention_size", 1), "ring_attention_size")
    ulysses = read.int_at_least(section.get("ulysses_parallel_size", 1), "ulysses_parallel_size")
    if ring > 1 and ulysses > 1:
        out.refused.append(
            f"{prefix}ring_attention_size: {ring} with ulysses_parallel_size {ulysses}: hybrid context parallelism "
            "(Ulysses inside ring) is not supported here; set one of them to 1"
        )
    elif ring > 1:  # the same attention, computed by gathering keys/values (NPU-only in MindSpeed MM)
        fsdp2.update(context_parallel_size=ring, context_parallel_algo="kv_allgather")
        mapped(
            "ring_attention_size",
            f"fsdp2_config.context_parallel_size: {ring}, context_parallel_algo: kv_allgather (ring attention's "
            "zig-zag layout and results, keys/values all-gathered)",
        )
    elif "ring_attention_size" in section:
        mapped("ring_attention_size: 1", "none: no ring attention, as here")
    if ulysses > 1:  # the FSDP2 config's key (MMFSDP2Strategy(context_parallel_size=...) is its alias)
        fsdp2["context_parallel_size"] = ulysses
        mapped("ulysses_parallel_size", f"fsdp2_config.context_parallel_size: {ulysses}")
    elif "ulysses_parallel_size" in section:
        mapped("ulysses_parallel_size", "none (1): fsdp2_config.context_parallel_size 1, the default")


def _map_fsdp_plan(section: Mapping[str, Any], prefix: str, read: _Reader, out: NativeParallel) -> None:
    """``fsdp_plan``: the FSDP units and their options."""
    fsdp2 = out.fsdp2

    def mapped(key: str, target: str) -> None:
        out.mapped.append(f"{prefix}{key} -> {target}")

    plan = read.section(section.get("fsdp_plan"), "fsdp_plan", FSDP_PLAN_KEYS)
    read.prefix = f"{prefix}fsdp_plan."
    if "apply_modules" in plan:
        fsdp2["sub_modules_to_wrap"] = read.patterns(plan["apply_modules"], "apply_modules")
        mapped("fsdp_plan.apply_modules", "fsdp2_config.sub_modules_to_wrap")
    if "ignored_modules" in plan:
        fsdp2["ignored_modules"] = read.patterns(plan["ignored_modules"], "ignored_modules")
        mapped("fsdp_plan.ignored_modules", "fsdp2_config.ignored_modules")
    else:  # FSDPPlanConfig's default ([]): nothing ignored, where this project's default would ignore a frozen tower
        from lightning_mm.mindspeed.ignored_default import WHY

        fsdp2["ignored_modules"] = []
        mapped("fsdp_plan.ignored_modules (default [])", f"fsdp2_config.ignored_modules: [] ({WHY})")
    for key in _SAME:
        if key in plan and plan[key] is not None:
            fsdp2[key] = plan[key]
            mapped(f"fsdp_plan.{key}", f"fsdp2_config.{key}")
    if "num_to_forward_prefetch" not in fsdp2:
        fsdp2["num_to_forward_prefetch"] = 0
    if "num_to_backward_prefetch" not in fsdp2:
        fsdp2["num_to_backward_prefetch"] = 0  # MindSpeed MM's default (this project's is 1)
        mapped("fsdp_plan.num_to_backward_prefetch (default 0)", "fsdp2_config.num_to_backward_prefetch: 0")
    if "cpu_offload" in plan:
        fsdp2["offload_to_cpu"] = read.flag(plan["cpu_offload"], "cpu_offload")
        mapped("fsdp_plan.cpu_offload", "fsdp2_config.offload_to_cpu")
    for key in ("pregather", "hook_modules"):
        if plan.get(key):
            out.without_effect.append(f"{prefix}fsdp_plan.{key}: {_WITHOUT_EFFECT['fsdp_plan.' + key]}")
        elif key in plan:
            mapped(f"fsdp_plan.{key}: {plan[key]}", "off: nothing to set")
    read.prefix = prefix


def _map_experts(section: Mapping[str, Any], prefix: str, read: _Reader, out: NativeParallel) -> None:
    """``expert_parallel_size``, ``expert_fully_shard_parallel_size`` and ``ep_plan``."""
    fsdp2 = out.fsdp2

    def mapped(key: str, target: str) -> None:
        out.mapped.append(f"{prefix}{key} -> {target}")

    ep = read.int_at_least(section.get("expert_parallel_size", 1), "expert_parallel_size")
    fsdp2["expert_parallel_size"] = ep
    if "expert_parallel_size" in section:
        mapped("expert_parallel_size", f"fsdp2_config.expert_parallel_size: {ep}")
    efsdp = section.get("expert_fully_shard_parallel_size")
    if efsdp is not None:
        read.int_at_least(efsdp, "expert_fully_shard_parallel_size")
        fsdp2["reshard_local_experts"] = efsdp != 1
        mapped(
            "expert_fully_shard_parallel_size",
            f"fsdp2_config.reshard_local_experts: {efsdp != 1}"
            + (
                ""
                if efsdp == 1
                else f" (the local experts are sharded over world / expert_parallel_size ranks, which must be {efsdp})"
            ),
        )
    ep_plan = read.section(section.get("ep_plan"), "ep_plan", EP_PLAN_KEYS)
    read.prefix = f"{prefix}ep_plan."
    if "apply_modules" in ep_plan:
        modules = read.patterns(ep_plan["apply_modules"], "apply_modules")
        if ep > 1:
            fsdp2["moe_modules"] = modules
            mapped("ep_plan.apply_modules", "fsdp2_config.moe_modules")
            # MindSpeed MM (distributed/torch_parallelize.py, ParallelApplier.apply_ep_modules) shards the EP
            # modules over the expert-FSDP mesh, then removes them from fsdp_plan.apply_modules (the same strings)
            # so that they are not fully_shard-ed twice: here the moe_modules are sharded by expert parallelism.
            efsdp_modules = read.patterns(ep_plan.get("apply_efsdp_modules"), "apply_efsdp_modules") or modules
            wrapped = fsdp2.get("sub_modules_to_wrap", [])
            both = [m for m in wrapped if m in efsdp_modules]
            if both:
                fsdp2["sub_modules_to_wrap"] = [m for m in wrapped if m not in efsdp_modules]
                mapped(
                    "fsdp_plan.apply_modules " + ", ".join(both),
                    "left out of fsdp2_config.sub_modules_to_wrap: also in ep_plan, so sharded by expert "
                    "parallelism (moe_modules), as MindSpeed MM removes them from the FSDP plan",
                )
        else:
            mapped("ep_plan.apply_modules", "nothing to set: expert_parallel_size is 1 (no expert parallelism)")
    if ep_plan.get("use_npu_fused_ops"):
        out.without_effect.append(f"{prefix}ep_plan.use_npu_fused_ops: {_WITHOUT_EFFECT['ep_plan.use_npu_fused_ops']}")
    elif "use_npu_fused_ops" in ep_plan:
        mapped("ep_plan.use_npu_fused_ops: false", "off: nothing to set")
    for key in ("apply_efsdp_modules", "_gradient_divide_factor"):
        if key in ep_plan and not ep_plan[key]:
            mapped(f"ep_plan.{key}: {ep_plan[key]}", "unset: nothing to set")
    if "dispatcher" in ep_plan:
        kind = ep_plan["dispatcher"]
        if kind not in _DISPATCHERS:
            raise read.fail(
                "dispatcher", f"{short_repr(kind)} is not a MindSpeed MM dispatcher (alltoall, allgather, mc2)"
            )
        if _DISPATCHERS[kind] is None:
            mapped("ep_plan.dispatcher: alltoall", "the all-to-all token exchange of expert parallelism here")
        else:
            out.without_effect.append(f"{prefix}ep_plan.dispatcher: {kind}: {_DISPATCHERS[kind]}")
    if ep_plan.get("apply_efsdp_modules"):
        efsdp_modules = read.patterns(ep_plan["apply_efsdp_modules"], "apply_efsdp_modules")
        if efsdp_modules != fsdp2.get("moe_modules", efsdp_modules):
            out.refused.append(
                f"{prefix}ep_plan.apply_efsdp_modules: differs from ep_plan.apply_modules; here the "
                "local experts of the moe_modules are the ones sharded over their replicas"
            )
        else:
            mapped("ep_plan.apply_efsdp_modules", "the moe_modules (reshard_local_experts)")
    if ep_plan.get("_gradient_divide_factor") is not None:
        out.refused.append(
            f"{prefix}ep_plan._gradient_divide_factor: a private MindSpeed MM scaling of the experts' "
            "gradients; here they are averaged over the data-parallel ranks like every gradient"
        )
    read.prefix = prefix


def _map_tp_plan(plan: Mapping[str, Any], tp: int, prefix: str, read: _Reader, out: NativeParallel) -> None:
    """``tp_plan.colwise_parallel`` / ``rowwise_parallel`` (module patterns) -> ``tp_plan`` in Transformers'
    notation (pattern -> ``colwise`` / ``rowwise``; MindSpeed MM's ``{*}`` segment is ``*`` there)."""
    read.prefix = f"{prefix}tp_plan."
    styles: dict[str, str] = {}
    for key, style in (("colwise_parallel", "colwise"), ("rowwise_parallel", "rowwise")):
        for pattern in read.patterns(plan.get(key), key):
            parts = ["*" if part == "{*}" else part for part in pattern.split(".")]
            if any("{" in part or "}" in part or not part for part in parts):
                raise read.fail(
                    key, f"'{pattern}': only whole-segment `{{*}}` wildcards can be mapped onto a tensor-parallel plan"
                )
            tp_pattern = ".".join(parts)
            if styles.get(tp_pattern, style) != style:
                raise read.fail(key, f"'{pattern}' is also in tp_plan.colwise_parallel; a module has one style")
            styles[tp_pattern] = style
        if key in plan and not plan[key]:
            out.mapped.append(f"{prefix}tp_plan.{key}: empty -> nothing to set")
    read.prefix = prefix
    if plan.get("sequence_parallel"):
        read.patterns(plan["sequence_parallel"], "tp_plan.sequence_parallel")
        out.refused.append(
            f"{prefix}tp_plan.sequence_parallel: sequence-parallel regions are not supported here (the row-parallel "
            "outputs are all-reduced to whole sequences); remove it"
        )
    elif "sequence_parallel" in plan:
        out.mapped.append(f"{prefix}tp_plan.sequence_parallel: empty -> nothing to set")
    if not styles:
        return
    if tp == 1:
        out.mapped.append(
            f"{prefix}tp_plan -> nothing to set: tensor_parallel_size is 1 (no tensor parallelism, as in MindSpeed MM)"
        )
        return
    out.fsdp2["tp_plan"] = styles
    out.mapped.append(f"{prefix}tp_plan.colwise_parallel, {prefix}tp_plan.rowwise_parallel -> fsdp2_config.tp_plan")


def _map_recompute(section: Mapping[str, Any], prefix: str, read: _Reader, out: NativeParallel) -> None:
    if "recompute" not in section and "recompute_plan" not in section:
        return
    on = read.flag(section.get("recompute", False), "recompute")
    plan = read.section(section.get("recompute_plan"), "recompute_plan", RECOMPUTE_PLAN_KEYS)
    modules = read.patterns(plan.get("apply_modules"), "recompute_plan.apply_modules")
    if "use_reentrant" in plan:
        out.fsdp2["use_reentrant"] = read.flag(plan["use_reentrant"], "recompute_plan.use_reentrant")
        out.mapped.append(f"{prefix}recompute_plan.use_reentrant -> fsdp2_config.use_reentrant")
    if on:
        known = out.fsdp2.setdefault("recompute_modules", [])
        known += [m for m in modules if m not in known]
        out.mapped.append(
            f"{prefix}recompute, {prefix}recompute_plan.apply_modules -> fsdp2_config.recompute_modules"
            + ("" if modules else " (empty: nothing is recomputed, as in MindSpeed MM)")
        )
    elif modules or "recompute" in section:
        out.mapped.append(
            f"{prefix}recompute: false, {prefix}recompute_plan.apply_modules -> no recompute_modules "
            "(the plan is not applied, as in MindSpeed MM)"
        )


def fsdp2_config_from_native(data: Mapping[str, Any], source: str | None = None) -> FSDP2Config:
    """The :class:`~lightning_mm.core.config.FSDP2Config` of a native ``parallel:`` section or a whole native config;
    errors are :class:`~lightning_mm.core.config.FSDP2ConfigError` naming the native key.

    This is what :func:`lightning_mm.mindspeed.load.fsdp2_config` (and so ``MMFSDP2Strategy(fsdp2_config=...)``)
    does with that layout. A key that changes what is computed and cannot be honoured here is an error naming it.
    Keys that only tune speed are accepted with one warning naming them. Of a whole
    config only ``parallel`` and ``features.recompute*`` are read: the other sections are the model's, the data's and
    the Trainer's (``lightning-mm migrate`` maps them).
    """
    error = FSDP2ConfigError
    layout = native_layout(data)
    if layout == "config":
        result = map_parallel(data["parallel"], data.get("features"), source, error=error)
    else:
        result = map_parallel(data, None, source, prefix="", error=error)
    where = f" in {source}" if source else ""
    if result.refused:
        raise error(f"native FSDP2 config{where}: {result.refused[0]}")
    if result.without_effect:
        warnings.warn(f"native FSDP2 config{where}: no effect here: " + "; ".join(result.without_effect), stacklevel=3)
    try:
        return FSDP2Config.from_dict(result.fsdp2, source=source)
    except error as err:  # name the key as the native config writes it
        match = re.match(r"FSDP2 config key `(\w+)`(?: in .*?)?: (.*)", str(err), re.S)
        if match is None or match.group(1) not in _NATIVE_NAMES:
            raise
        prefix = "parallel." if layout == "config" else ""
        raise error(
            f"native FSDP2 config key `{prefix}{_NATIVE_NAMES[match.group(1)]}`{where}: {match.group(2)}"
        ) from None


_NATIVE_NAMES = {
    "sharding_size": "fully_shard_parallel_size",
    "sub_modules_to_wrap": "fsdp_plan.apply_modules",
    "ignored_modules": "fsdp_plan.ignored_modules",
    "recompute_modules": "recompute_plan.apply_modules",
    "offload_to_cpu": "fsdp_plan.cpu_offload",
    "moe_modules": "ep_plan.apply_modules",
    "expert_parallel_size": "expert_parallel_size",
    "tensor_parallel_size": "tensor_parallel_size",
    "tp_plan": "tp_plan",
    **{k: f"fsdp_plan.{k}" for k in _SAME},
}
