"""Tensor parallelism of a language model from a Transformers-notation plan, with torch's DTensor.

A plan maps module patterns (``layers.*.self_attn.q_proj``; ``*`` one path component) to a style in Transformers'
notation (``base_model_tp_plan``): ``colwise``, ``rowwise`` and ``replicated_with_grad_allreduce``. It is applied
with ``parallelize_module`` over the ``tp`` mesh before ``fully_shard`` (2-D: TP inside, FSDP2 across the
data-parallel ranks), as torchtitan does. Lightning-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_mm.core.config import TP_STYLES, FSDP2Config, FSDP2ConfigError
from lightning_mm.core.layout import ParallelLayout

__all__ = [
    "STYLES",
    "TensorParallelError",
    "plan_tensor_parallel",
    "model_tp_plan",
    "resolve_tp_plan",
    "apply_tensor_parallel",
]

STYLES = TP_STYLES
"""The styles of Transformers' plan notation that are supported."""

_FUSED = re.compile(r"(^|[._])(qkv|gate_up|w13|query_key_value|in_proj)([._]|$)")


class TensorParallelError(FSDP2ConfigError):
    """A tensor-parallel plan that cannot be applied to the model (raised before compute)."""


def model_tp_plan(target: nn.Module) -> dict[str, str] | None:
    """The first Transformers model in ``target`` with a ``base_model_tp_plan`` in its config: that plan with each
    pattern made relative to ``target`` (its base model's path prepended); ``None`` when there is none."""
    for path, module in target.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        prefix = getattr(module, "base_model_prefix", None)
        if not plan or not isinstance(prefix, str):
            continue
        base = ".".join(p for p in (path, prefix) if p)
        if base and not _has(target, base):
            base = path
        return {(f"{base}.{k}" if base else k): v for k, v in plan.items()}
    return None


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _pattern(pattern: str) -> re.Pattern[str]:
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")) + "$")


def resolve_tp_plan(
    target: nn.Module,
    plan: Mapping[str, str],
    source: str | None = None,
    own: bool = False,
    experts: tuple[str, ...] = (),
) -> dict[str, str]:
    """``plan`` (pattern -> style, ``*`` one path component) resolved to module paths of ``target``; refused:
    a pattern that matches nothing, an unknown style, a style on a module it cannot split (``colwise`` and
    ``rowwise`` need an ``nn.Linear``) and a fused projection (q/k/v or gate/up in one weight: an even column split
    would mix its parts).

    ``own``: ``plan`` is the model's own ``base_model_tp_plan`` (not the YAML's): a pattern of it that matches
    nothing is skipped (a MoE model's plan also names the dense MLP of layers it may not have). ``experts``: the
    MoE modules of expert parallelism, which split the experts themselves: the plan's entries for them (and for
    modules inside them) are left out."""
    where = f" in {source}" if source else ""

    def fail(pattern: str, message: str) -> TensorParallelError:
        if own:  # not the user's key: the model's plan, taken for `tensor_parallel_size`
            return TensorParallelError(
                f"FSDP2 config key `tensor_parallel_size`{where}: {type(target).__name__}'s base_model_tp_plan entry "
                f"'{pattern}': {message} (or give a `tp_plan`, or split MoE experts with `expert_parallel_size`)"
            )
        return TensorParallelError(f"FSDP2 config key `tp_plan`{where}: '{pattern}': {message}")

    def expert(path: str) -> bool:
        return any(path == e or path.startswith(e + ".") for e in experts)

    modules = dict(target.named_modules())
    tensors = [n for n, _ in target.named_parameters()] if experts else []  # entries such as `experts.down_proj`
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        regex = _pattern(pattern)
        paths = [p for p in modules if p and regex.match(p)]
        named = paths or [n for n in tensors if regex.match(n)]
        if named and all(expert(p) for p in named):
            continue  # split by expert parallelism
        if style not in STYLES:
            raise fail(pattern, f"style {style!r} is not supported with tensor parallelism here; use one of {STYLES}")
        if not paths:
            if own:
                continue
            raise fail(pattern, f"matches no module of {type(target).__name__}")
        for path in paths:
            if expert(path):
                continue
            module = modules[path]
            if style in ("colwise", "rowwise") and type(module) is not nn.Linear:
                raise fail(pattern, f"'{path}' is a {type(module).__name__}, not an nn.Linear; {style} cannot split it")
            if _FUSED.search(path):
                raise fail(
                    pattern,
                    f"'{path}' is a fused projection (several projections in one weight): an even {style} split "
                    "would mix them; tensor parallelism does not cover it yet",
                )
            resolved[path] = style
    return resolved


def apply_tensor_parallel(target: nn.Module, resolved: Mapping[str, str], tp_mesh: Any) -> None:
    """Split the modules of ``resolved`` (module path -> style) over ``tp_mesh`` with ``parallelize_module``
    (before ``fully_shard``): ``colwise`` -> ``ColwiseParallel``, ``rowwise`` -> ``RowwiseParallel`` (outputs
    all-reduced to whole tensors), ``replicated_with_grad_allreduce`` -> ``SequenceParallel`` over the heads
    dimension (-2): a per-head norm after a column-parallel projection, its weight replicated and its gradient
    summed over the ranks."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    def style_of(name: str) -> ParallelStyle:
        if name == "colwise":
            return ColwiseParallel()
        if name == "rowwise":
            return RowwiseParallel()
        return SequenceParallel(sequence_dim=-2, use_local_output=True)

    parallelize_module(target, tp_mesh, {path: style_of(style) for path, style in resolved.items()})


def plan_tensor_parallel(
    config: FSDP2Config,
    model: nn.Module,
    layout: ParallelLayout,
    recompute: list[str],
    compiled: list[str],
    experts: tuple[str, ...] = (),
) -> tuple[tuple[str, str], ...]:
    """The resolved tensor-parallel plan of a run (``()`` without tensor parallelism): the YAML ``tp_plan`` or the
    model's own ``base_model_tp_plan``, checked against the model (:meth:`ParallelLayout.check_model`); what does
    not compose with tensor parallelism yet is refused here, by name. ``experts``: the MoE modules that expert
    parallelism splits over its own ``ep`` mesh (left out of the plan: attention and dense layers are TP'd, the
    experts EP'd, the routers replicated)."""
    if layout.tp == 1:
        return ()
    where = f" in {config.source}" if config.source else ""
    plan = config.tp_plan if config.tp_plan is not None else model_tp_plan(model)
    if not plan:
        raise TensorParallelError(
            f"FSDP2 config key `tensor_parallel_size`{where}: {layout.tp}, but {type(model).__name__} has no "
            "Transformers `base_model_tp_plan`; give a `tp_plan`"
        )
    for path, module in model.named_modules():
        hf_config = getattr(module, "config", None)
        if getattr(hf_config, "num_attention_heads", None) is not None:
            layout.check_model(hf_config, path or type(model).__name__)
            break
    refused = [
        ("recompute_modules", recompute),
        ("compile_modules", compiled),
        ("ignored_modules", config.ignored_modules),
    ]
    for key, value in refused:
        if value:
            raise TensorParallelError(
                f"FSDP2 config key `{key}`{where}: not supported with tensor_parallel_size {layout.tp} yet; remove it "
                "or set tensor_parallel_size: 1"
            )
    lora = next((n for n, _ in model.named_parameters() if "lora_" in n), None)
    if lora is not None:
        raise TensorParallelError(
            f"FSDP2 config key `tensor_parallel_size`{where}: {layout.tp} with LoRA adapters ('{lora}') is not "
            "supported yet; train LoRA with tensor_parallel_size: 1"
        )
    own = config.tp_plan is None
    return tuple(resolve_tp_plan(model, plan, config.source, own=own, experts=experts).items())
