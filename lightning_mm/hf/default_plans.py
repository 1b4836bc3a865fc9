"""The default FSDP2 plan of a Hugging Face model, read from the model's own metadata (pure: no processes).

* Units: every repeated block (a module whose class is in the model's ``_no_split_modules`` and that sits in an
  ``nn.ModuleList``: decoder layers, vision blocks), plus the input and output embeddings. Tied embeddings share
  a parameter, so the plan builder puts them in one unit.
* The multimodal projector between a vision tower and the language model (``multi_modal_projector``), or the
  paths of the class attribute ``fsdp2_extra_units`` (Qwen2.5-VL's ``model.visual.merger``; patterns such as
  Qwen3-VL's ``model.visual.deepstack_merger_list.{*}`` allowed, a pattern matching nothing in this config is
  left out): as a unit of its own the projector computes in ``param_dtype`` whatever dtype the (possibly
  ignored, full-precision) tower returns, and its parameters are not left in the root unit.
* A trainable vision tower's input embeddings (the tower's child that holds its ``get_input_embeddings()``: patch
  and position embeddings), so that only small norms stay in the root unit.
* A vision tower (the sub-model built from ``config.vision_config``, or the paths in the class attribute
  ``fsdp2_vision_towers``) whose parameters are all frozen goes to ``ignored_modules`` and its blocks are not
  wrapped: it is kept whole on every rank and never communicates.

The result is a dict of FSDP2 YAML keys, expressed with the seed's patterns (``model.layers.{*}``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_mm._module_paths import is_under

__all__ = [
    "hf_default_fsdp2_config", "block_paths", "vision_tower_paths", "frozen_vision_towers", "input_embedding_units",
    "compress_paths", "moe_module_paths",
]


def block_paths(model: nn.Module) -> list[str]:
    """The outermost repeated blocks: ``_no_split_modules`` classes that are items of an ``nn.ModuleList``."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    lists = {name for name, module in model.named_modules() if isinstance(module, nn.ModuleList)}
    found: list[str] = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if type(module).__name__ in classes and parent in lists and not any(is_under(name, f) for f in found):
            found.append(name)
    return found


def vision_tower_paths(model: nn.Module) -> list[str]:
    """Sub-models built from ``config.vision_config``, or the class's ``fsdp2_vision_towers`` if it sets them."""
    declared = getattr(type(model), "fsdp2_vision_towers", None)
    if declared is not None:
        return list(declared)
    vision_config = getattr(getattr(model, "config", None), "vision_config", None)
    if vision_config is None:
        return []
    towers: list[str] = []
    for name, module in model.named_modules():
        if name and getattr(module, "config", None) is vision_config and not any(is_under(name, t) for t in towers):
            towers.append(name)
    return towers


def frozen_vision_towers(model: nn.Module) -> list[str]:
    """Vision towers whose parameters are all frozen (``requires_grad=False``)."""
    frozen = []
    for path in vision_tower_paths(model):
        params = list(model.get_submodule(path).parameters())
        if params and not any(p.requires_grad for p in params):
            frozen.append(path)
    return frozen


def _module_path(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, module in model.named_modules() if module is target and name), None)


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
        if indices == list(range(len(model.get_submodule(item)))):
            result.append(f"{item}.{{*}}")
            continue
        ranges, start = [], indices[0]
        for prev, cur in zip(indices, [*indices[1:], None]):
            if cur != prev + 1:
                ranges.append(str(start) if start == prev else f"{start}-{prev}")
                start = cur
        result.append(f"{item}.{{{','.join(ranges)}}}")
    return result


def input_embedding_units(model: nn.Module, towers: list[str]) -> list[str]:
    """For each vision tower, its child that holds the tower's input (patch) embeddings, with their position
    embeddings: ``model.visual.patch_embed``, ``model.vision_tower.embeddings``."""
    found = []
    for tower_path in towers:
        tower = model.get_submodule(tower_path)
        getter = getattr(tower, "get_input_embeddings", None)
        try:
            embedding = getter() if callable(getter) else None
        except (NotImplementedError, AttributeError):
            embedding = None
        path = _module_path(tower, embedding)
        if path:
            found.append(f"{tower_path}.{path.split('.')[0]}")
    return found


def _resolved(model: nn.Module, patterns: list[str]) -> list[str]:
    from lightning_mm.core.patterns import PatternError, resolve_patterns

    paths = []
    for pattern in patterns:
        try:
            paths += resolve_patterns(model, [pattern], "ignored_modules")
        except PatternError:
            pass  # build_plan reports it, with the file it came from
    return paths


def moe_module_paths(model: nn.Module) -> list[str]:
    """Transformers 5's expert modules: a class named ``...Experts`` with ``num_experts`` and parameters."""
    return [
        name for name, module in model.named_modules()
        if type(module).__name__.endswith("Experts") and isinstance(getattr(module, "num_experts", None), int)
        and any(True for _ in module.parameters(recurse=False))
    ]


def hf_default_fsdp2_config(model: nn.Module, ignored: list[str] | None = None) -> dict[str, Any]:
    """``sub_modules_to_wrap`` (and ``ignored_modules`` for frozen vision towers) for a Hugging Face model.

    ``ignored``: the ``ignored_modules`` the user set (patterns allowed); then no default unit lies inside them
    and no ``ignored_modules`` default is given.
    """
    user_ignored = ignored is not None
    ignored = _resolved(model, list(ignored)) if user_ignored else frozen_vision_towers(model)
    wrap = [p for p in block_paths(model) if not any(is_under(p, t) for t in ignored)]
    embeddings = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            module = fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            module = None
        path = _module_path(model, module)
        if path and not any(is_under(path, t) for t in ignored) and path not in embeddings:
            embeddings.append(path)
    names = {name for name, _ in model.named_modules()}
    declared = getattr(type(model), "fsdp2_extra_units", None)
    if declared is None:  # Transformers' VLMs name the module between the vision tower and the LM this way
        declared = [n for n in names if n.rpartition(".")[2] == "multi_modal_projector"]
    else:
        declared = _resolved(model, list(declared))
    towers = [t for t in vision_tower_paths(model) if t in names]
    extra = [p for p in dict.fromkeys([*input_embedding_units(model, towers), *declared])
             if p in names and not any(is_under(p, t) for t in ignored)]
    config: dict[str, Any] = {"sub_modules_to_wrap": compress_paths(model, embeddings + extra + wrap)}
    moe = [p for p in moe_module_paths(model) if not any(is_under(p, t) for t in ignored)]
    if moe:
        config["moe_modules"] = moe
    if ignored and not user_ignored:
        config["ignored_modules"] = ignored
    return config
