"""The default FSDP2 plan of any Hugging Face model, derived from the model's own metadata (pure: no processes).

:func:`derive_fsdp2_plan` reads what every ``transformers.PreTrainedModel`` declares and returns a
:class:`DerivedPlan`; :func:`hf_default_fsdp2_config` gives its FSDP2 YAML keys (what ``FSDP2Mixin`` supplies
where the YAML leaves them unset). The rules:

* **Blocks**: the outermost items of an ``nn.ModuleList`` whose class is in the model's ``_no_split_modules``
  (decoder layers, vision and audio blocks); where a list's items are not themselves of such a class but hold one
  (Idefics3 lists ``Idefics3VisionAttention``, the attention inside its encoder layers), the items are the blocks.
  Each block is a unit.
* **Embeddings and head**: ``get_input_embeddings()`` and ``get_output_embeddings()`` are units; tied ones
  (``_tied_weights_keys``) share a parameter, so the plan builder puts them in one unit.
* **Towers**: the sub-models built from one of the config's sub-configs other than the text model's
  (``vision_config``, ``audio_config``: ``model.visual``, ``model.vision_tower``, ``model.audio_tower``), or the
  paths of the class attribute ``fsdp2_vision_towers``. A tower whose parameters are all frozen goes to
  ``ignored_modules`` (kept whole on every rank, it never communicates) and nothing inside it is a unit, unless the
  YAML's own ``sub_modules_to_wrap`` shards it or a module inside it.
* **The rest**: walking down from the root through every module that holds a unit or a tower, each other child
  with parameters is a unit of its own (the items of a list: one each), except a norm, which stays in the root
  unit. This finds the projector between a tower and the decoder (``multi_modal_projector``, Idefics3's
  ``connector``, Qwen's ``visual.merger``), a tower's patch and position embeddings and its DeepStack mergers, so
  that only norms stay in the root unit. As a unit of its own a projector computes in ``param_dtype`` whatever
  dtype the (possibly ignored, full-precision) tower returns. The class attribute ``fsdp2_extra_units`` (paths
  or patterns) replaces this part for a model that needs other units.
* **Experts**: modules in Transformers 5's fused layout (a class named ``...Experts`` with an integer
  ``num_experts`` and 3-D weights whose first dimension is the experts) are the ``moe_modules`` that
  ``expert_parallel_size`` > 1 splits.
* **Recomputation candidates**: the blocks (not applied by default: ``recompute_modules`` decides).

A model the rules cannot decide for (no ``_no_split_modules``, none of its classes in the model, a trainable
tower without blocks) is a :class:`PlanDerivationError` naming the YAML keys to set instead. The results use
MindSpeed MM's patterns (``model.layers.{*}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from torch import nn

from lightning_mm._compat import no_split_modules, tied_weights_keys
from lightning_mm._utils.modules import is_under, is_under_any
from lightning_mm._utils.suggestions import listing
from lightning_mm.core.config import FSDP2ConfigError
from lightning_mm.core.norms import is_norm
from lightning_mm.core.patterns import PatternError, names_inside, names_or_contains, resolve_patterns

__all__ = [
    "DerivedPlan",
    "PlanDerivationError",
    "derive_fsdp2_plan",
    "hf_default_fsdp2_config",
    "block_paths",
    "tower_paths",
    "vision_tower_paths",
    "frozen_vision_towers",
    "compress_paths",
    "moe_module_paths",
]


class PlanDerivationError(FSDP2ConfigError):
    """The model's metadata does not decide a default plan; the message names the YAML keys to set."""


@dataclass(frozen=True)
class DerivedPlan:
    """What :func:`derive_fsdp2_plan` found (module paths, patterns where a list is covered)."""

    model_class: str
    sub_modules_to_wrap: tuple[str, ...]
    ignored_modules: tuple[str, ...] = ()
    """Frozen towers (empty when the user set ``ignored_modules``: then theirs are used)."""
    moe_modules: tuple[str, ...] = ()
    recompute_candidates: tuple[str, ...] = ()
    """The blocks, as patterns: what ``recompute_modules`` would typically name."""
    towers: tuple[str, ...] = ()
    no_split_modules: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    """``target -> source`` of the tied parameters the model declares."""
    declared: tuple[str, ...] = field(default=())
    """The class attributes that replaced a rule (``fsdp2_vision_towers``, ``fsdp2_extra_units``)."""

    def fsdp2_defaults(self) -> dict[str, Any]:
        """The FSDP2 YAML keys of this plan (``sub_modules_to_wrap``, ``moe_modules``, ``ignored_modules``)."""
        config: dict[str, Any] = {"sub_modules_to_wrap": list(self.sub_modules_to_wrap)}
        if self.moe_modules:
            config["moe_modules"] = list(self.moe_modules)
        if self.ignored_modules:
            config["ignored_modules"] = list(self.ignored_modules)
        return config

    def describe(self) -> str:
        """Where the default plan came from, for ``lightning-mm plan``."""
        rules = "; ".join(f"{d} declared by the class" for d in self.declared)
        lines = [
            f"  default plan: derived from {self.model_class}'s Transformers metadata"
            + (f" ({rules})" if rules else ""),
            f"    _no_split_modules: {', '.join(self.no_split_modules) or '-'}; towers: {', '.join(self.towers) or '-'}"
            f"; tied: {', '.join(self.tied) or '-'}",
            f"    recompute candidates (for `recompute_modules`): {', '.join(self.recompute_candidates) or '-'}",
        ]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ blocks
def _no_split(model: nn.Module) -> set[str]:
    return no_split_modules(model)


def block_paths(model: nn.Module) -> list[str]:
    """The outermost repeated blocks: items of an ``nn.ModuleList`` whose class is in ``_no_split_modules``, or,
    in a list with none of those inside, items that hold an instance of such a class."""
    classes = _no_split(model)
    modules = dict(model.named_modules())
    lists = {name for name, module in modules.items() if isinstance(module, nn.ModuleList)}
    items = [name for name in modules if name and name.rpartition(".")[0] in lists]
    exact: list[str] = []
    for name in items:
        if type(modules[name]).__name__ in classes and not is_under_any(name, exact):
            exact.append(name)
    holding: list[str] = []
    for name in items:
        if any(is_under(name, f) or is_under(f, name) for f in [*exact, *holding]):
            continue
        if any(type(m).__name__ in classes for m in modules[name].modules()):
            holding.append(name)
    order = {name: i for i, name in enumerate(modules)}
    return sorted(exact + holding, key=order.__getitem__)


# ------------------------------------------------------------------------------------------------ towers
def _sub_configs(model: nn.Module) -> list[tuple[str, Any]]:
    config = getattr(model, "config", None)
    names = list(getattr(config, "sub_configs", None) or {}) or ["vision_config"]
    found = [(name, getattr(config, name, None)) for name in names]
    return [(n, c) for n, c in found if c is not None]


def tower_paths(model: nn.Module) -> list[str]:
    """The class's ``fsdp2_vision_towers`` if it sets them, else the outermost sub-models built from a sub-config
    other than the text model's (the one holding the input embeddings): ``vision_config``, ``audio_config``."""
    declared = getattr(type(model), "fsdp2_vision_towers", None)
    if declared is not None:
        return list(declared)
    embeddings = _embedding_paths(model)[:1]
    configs = [c for name, c in _sub_configs(model) if name != "text_config"]
    towers: list[str] = []
    for name, module in model.named_modules():
        if not name or is_under_any(name, towers):
            continue
        built_from = getattr(module, "config", None)
        if any(built_from is c for c in configs) and not any(is_under(e, name) for e in embeddings):
            towers.append(name)
    return towers


vision_tower_paths = tower_paths  # the earlier name


def frozen_vision_towers(model: nn.Module) -> list[str]:
    """Towers whose parameters are all frozen (``requires_grad=False``)."""
    frozen = []
    for path in tower_paths(model):
        params = list(model.get_submodule(path).parameters())
        if params and not any(p.requires_grad for p in params):
            frozen.append(path)
    return frozen


# -------------------------------------------------------------------------------------- embeddings, rest
def _module_path(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, module in model.named_modules() if module is target and name), None)


def _embedding_paths(model: nn.Module) -> list[str]:
    """The input embeddings' path, then the output embeddings' (each when the model has it)."""
    found: list[str] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            module = fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            module = None
        path = _module_path(model, module)
        if path and path not in found:
            found.append(path)
    return found


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def remaining_units(model: nn.Module, units: Sequence[str], towers: Sequence[str], ignored: Sequence[str]) -> list[str]:
    """Walking down through each module that holds a unit or a tower: its other children with parameters (each
    item of a list), norms left out; nothing inside the ``ignored`` patterns."""
    found: list[str] = []
    holders = [*units, *towers]

    def visit(path: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if child_path in units or _inside(child_path, ignored) or not _has_parameters(child):
                continue
            if any(is_under(h, child_path) for h in holders):
                visit(child_path, child)
            elif isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(child_path, child)
            elif not is_norm(child):
                found.append(child_path)

    visit("", model)
    return found


def compress_paths(model: nn.Module, paths: list[str]) -> list[str]:
    """Write the items of one ``nn.ModuleList`` as one pattern: ``layers.{*}`` (all) or ``layers.{0-3,7}``."""
    by_parent: dict[str, list[int]] = {}
    out: list[str] = []
    for path in paths:
        parent, _, last = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(owner, nn.ModuleList) and last.isdigit():
            if parent not in by_parent:
                by_parent[parent] = []
                out.append(parent)  # placeholder, replaced below, keeps first-seen order
            by_parent[parent].append(int(last))
        else:
            out.append(path)
    result = []
    for item in out:
        if item not in by_parent:
            result.append(item)
            continue
        indices = sorted(set(by_parent[item]))
        if indices == list(range(len(cast(nn.ModuleList, model.get_submodule(item))))):  # by_parent: ModuleLists
            result.append(f"{item}.{{*}}")
            continue
        ranges: list[str] = []
        start: int | None = indices[0]
        for prev, cur in zip(indices, [*indices[1:], None]):
            if cur != prev + 1:
                ranges.append(str(start) if start == prev else f"{start}-{prev}")
                start = cur
        result.append(f"{item}.{{{','.join(ranges)}}}")
    return result


def _resolved(model: nn.Module, patterns: list[str]) -> list[str]:
    """The modules a model class's own ``fsdp2_extra_units`` patterns name (one that names none: skipped)."""
    paths = []
    for pattern in patterns:
        try:
            paths += resolve_patterns(model, [pattern], "fsdp2_extra_units")
        except PatternError:
            pass
    return paths


def _inside(path: str, patterns: Sequence[str]) -> bool:
    """Whether module ``path`` is or lies inside a module one of ``patterns`` names (the user's ``ignored_modules``,
    read without resolving them: the plan resolves them, once, and reports what they miss)."""
    return any(names_or_contains(pattern, path) for pattern in patterns)


def moe_module_paths(model: nn.Module) -> list[str]:
    """Transformers 5's fused expert modules: a class named ``...Experts`` with an integer ``num_experts`` whose own
    weights are 3-D with the experts first (``gate_up_proj``, ``down_proj``)."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        own = list(module.parameters(recurse=False))
        if (
            type(module).__name__.endswith("Experts")
            and isinstance(experts, int)
            and not isinstance(experts, bool)
            and own
            and all(p.ndim == 3 and p.shape[0] == experts for p in own)
        ):
            found.append(name)
    return found


# -------------------------------------------------------------------------------------------- the plan
def _list_patterns(model: nn.Module) -> list[str]:
    """``path.{*}`` for each outermost ``nn.ModuleList`` with parameters: what ``sub_modules_to_wrap`` could name."""
    found: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and _has_parameters(module) and not is_under_any(name, found):
            found.append(name)
    return [f"{name}.{{*}}" for name in found]


def _cannot_decide(model: nn.Module, why: str, keys: str = "`sub_modules_to_wrap`") -> PlanDerivationError:
    lists = _list_patterns(model)
    hint = f" (its module lists: {listing(lists, 6)})" if lists else ""
    return PlanDerivationError(
        f"cannot derive a default FSDP2 plan for {type(model).__name__}: {why}. Set {keys} in the FSDP2 YAML"
        f"{hint}, or register an adapter with its own plan (ModelHub.register)"
    )


def derive_fsdp2_plan(
    model: nn.Module, ignored: Sequence[str] | None = None, wrapped: Sequence[str] = ()
) -> DerivedPlan:
    """The default plan of a Hugging Face model (see the module docstring for the rules).

    ``ignored``: the ``ignored_modules`` the user set (patterns allowed); then no unit lies inside them and no
    ``ignored_modules`` default is given. ``wrapped``: the ``sub_modules_to_wrap`` the user set; a frozen tower
    that one of them names, or names a module inside, is not ignored by default (the user shards it, as MindSpeed
    MM does with such a YAML). Raises :class:`PlanDerivationError` where the metadata does not decide.
    """
    name = type(model).__name__
    classes = _no_split(model)
    if not classes:
        raise _cannot_decide(model, "it declares no `_no_split_modules` (the classes of its repeated blocks)")
    present = {type(m).__name__ for m in model.modules()}
    if not classes & present:
        raise _cannot_decide(
            model, f"none of its `_no_split_modules` ({', '.join(sorted(classes))}) is a module of this model"
        )
    blocks = block_paths(model)
    if not blocks:
        raise _cannot_decide(
            model,
            f"no item of an nn.ModuleList is or holds one of its `_no_split_modules` ({', '.join(sorted(classes))})",
        )
    user_ignored = ignored is not None
    towers = tower_paths(model)
    declared = ["fsdp2_vision_towers"] if getattr(type(model), "fsdp2_vision_towers", None) is not None else []
    if ignored is not None:
        ignore = list(ignored)  # patterns
    else:  # paths: the frozen towers the user's own units do not shard
        ignore = [t for t in frozen_vision_towers(model) if not any(names_inside(w, t) for w in wrapped)]
    blocks = [b for b in blocks if not _inside(b, ignore)]
    for tower in towers:
        if not any(names_inside(i, tower) or names_or_contains(i, tower) for i in ignore) and not any(
            is_under(b, tower) for b in blocks
        ):
            raise _cannot_decide(
                model,
                f"its tower '{tower}' holds no block of a `_no_split_modules` class",
                f"`sub_modules_to_wrap` (or `ignored_modules: [{tower}]` with the tower frozen through `freeze`)",
            )
    embeddings = [p for p in _embedding_paths(model) if not _inside(p, ignore)]
    extra_declared = getattr(type(model), "fsdp2_extra_units", None)
    if extra_declared is not None:
        declared.append("fsdp2_extra_units")
        names = {n for n, _ in model.named_modules()}
        extra = [p for p in _resolved(model, list(extra_declared)) if p in names]
    else:
        extra = remaining_units(model, [*embeddings, *blocks], towers, ignore)
    extra = [p for p in dict.fromkeys(extra) if p not in embeddings and not _inside(p, ignore)]
    moe = [p for p in moe_module_paths(model) if not _inside(p, ignore)]
    tied = getattr(model, "all_tied_weights_keys", None)  # what is tied in this config
    if tied is None:
        tied = tied_weights_keys(model) or {}
    tied_lines = [f"{t} -> {s}" for t, s in tied.items()] if isinstance(tied, dict) else [str(t) for t in tied]
    return DerivedPlan(
        model_class=name,
        sub_modules_to_wrap=tuple(compress_paths(model, embeddings + extra + blocks)),
        ignored_modules=tuple(ignore) if not user_ignored else (),
        moe_modules=tuple(moe),
        recompute_candidates=tuple(compress_paths(model, blocks)),
        towers=tuple(towers),
        no_split_modules=tuple(sorted(classes)),
        tied=tuple(tied_lines),
        declared=tuple(declared),
    )


def hf_default_fsdp2_config(model: nn.Module, ignored: list[str] | None = None) -> dict[str, Any]:
    """The FSDP2 YAML keys of :func:`derive_fsdp2_plan` (``sub_modules_to_wrap``, ``moe_modules``, and
    ``ignored_modules`` for frozen towers)."""
    return derive_fsdp2_plan(model, ignored).fsdp2_defaults()
