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

import torch
from torch import nn

from lightning_mm.core.chunked_loss import is_chunked_head
from lightning_mm.core.config import TP_STYLES, FSDP2Config, FSDP2ConfigError
from lightning_mm.core.parallel_layout import ParallelLayout

__all__ = [
    "STYLES",
    "TensorParallelError",
    "plan_tensor_parallel",
    "model_tp_plan",
    "resolve_tp_plan",
    "lora_styles",
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
    modules inside them) are left out.

    An output layer whose loss is chunked (``enable_chunk_loss``) is made column-parallel (its vocabulary split over
    the ``tp`` ranks: the chunked loss computes the vocabulary-parallel cross-entropy); refused for it: another
    style, LoRA adapters on it, and a weight tied to the input embeddings. Another output layer cannot be
    ``colwise`` (the loss would get a shard of the vocabulary)."""
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
    heads = _output_layers(modules.values())
    chunked = [p for p, m in modules.items() if p and is_chunked_head(m) and any(m is h for h in heads)]
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
            if path in chunked:
                if style != "colwise":
                    raise fail(
                        pattern,
                        f"'{path}' is the output layer of the chunked loss (enable_chunk_loss): under tensor "
                        f"parallelism it is column-parallel (vocabulary-parallel cross-entropy), not {style}",
                    )
                continue  # added below, checked there
            if path.endswith(".base_layer") or ".lora_" in path:
                raise fail(pattern, f"'{path}' is part of a LoRA layer; name the adapted layer itself")
            adapted = lora_styles(path, module, style)
            if adapted is not None:
                if _FUSED.search(path):
                    raise fail(pattern, f"'{path}' is a fused projection; tensor parallelism does not cover it yet")
                resolved.update(adapted)
                continue
            if style == "colwise" and any(module is head for head in heads):
                raise fail(
                    pattern,
                    f"'{path}' is the model's output layer: split by columns it would hand the loss a shard of the "
                    "vocabulary; the vocabulary-parallel cross-entropy is that of the chunked loss: set "
                    "`enable_chunk_loss`",
                )
            if style in ("colwise", "rowwise") and type(module) is not nn.Linear:
                raise fail(pattern, f"'{path}' is a {type(module).__name__}, not an nn.Linear; {style} cannot split it")
            if _FUSED.search(path):
                raise fail(
                    pattern,
                    f"'{path}' is a fused projection (several projections in one weight): an even {style} split "
                    "would mix them; tensor parallelism does not cover it yet",
                )
            resolved[path] = style
    for path in chunked:
        resolved[path] = _vocab_parallel_head(target, path, modules[path], where)
    if "sequence_parallel" in resolved.values():
        resolved.update(_sequence_parallel_region(target, resolved, where))
    return resolved


def _vocab_parallel_head(target: nn.Module, path: str, head: nn.Module, where: str) -> str:
    """The style of the chunked loss's output layer at ``path``: ``colwise`` (split by vocabulary rows), after
    refusing what the vocabulary-parallel chunked loss cannot split."""

    def fail(message: str) -> TensorParallelError:
        return TensorParallelError(
            f"FSDP2 config key `tensor_parallel_size`{where}: the chunked loss's output layer '{path}' {message}"
        )

    if _lora_parts(head) is not None:
        raise fail("has LoRA adapters; the vocabulary-parallel chunked loss splits a plain nn.Linear only")
    if type(head) is not nn.Linear:
        raise fail(f"is a {type(head).__name__}; the vocabulary-parallel chunked loss splits an nn.Linear only")
    for name, param in target.named_parameters(remove_duplicate=False):
        if param is head.weight and not name.startswith(f"{path}."):
            raise fail(
                f"shares its weight with '{name}' (`tie_word_embeddings`); column-parallel it would split the input "
                "embeddings too: untie them, or turn off `enable_chunk_loss`"
            )
    return "colwise"


def _shard_vocabulary(tp_mesh: Any) -> Any:
    """A ``distribute_module`` partition function: the output layer's weight and bias split by rows (the
    vocabulary) over ``tp_mesh``, with no input or output hooks (the chunked loss computes from the shards)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def partition(_: str, module: nn.Module, mesh: Any) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
            module.register_parameter(name, sharded)

    return partition


SP_ENTER, SP_EXIT, SP_REGION = "sequence_parallel_enter", "sequence_parallel_exit", "sequence_parallel_region"
"""Styles the resolved plan adds at the blocks that open and close the sequence-parallel region (one block: both)."""
SP_GATHER = "sequence_parallel_gather"
"""The style of a decoder layer's child that holds column-parallel layers (attention, MLP): its hidden-states input
is gathered along the sequence (as torchtitan's ``PrepareModuleInput`` on its attention and feed-forward)."""


def _output_layers(modules: Any) -> list[nn.Module]:
    """The output layers (``get_output_embeddings()``, Transformers' name for ``lm_head``) of ``modules``."""
    heads = []
    for module in modules:
        get = getattr(module, "get_output_embeddings", None)
        try:
            head = get() if callable(get) else None
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, nn.Module):
            heads.append(head)
    return heads


def _block_of(path: str, modules: Mapping[str, nn.Module]) -> str | None:
    """The element of an ``nn.ModuleList`` (a decoder layer) that ``path`` lies in, or ``None``."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if isinstance(modules.get(".".join(parts[:i])), nn.ModuleList):
            return ".".join(parts[: i + 1])
    return None


def _sequence_parallel_region(target: nn.Module, resolved: Mapping[str, str], where: str) -> dict[str, str]:
    """Sequence parallelism (``sequence_parallel`` norms): between the decoder layers of the plan the hidden states
    are split along the sequence over the ``tp`` ranks; the first layer splits its input, the last gathers its
    output. Checked: each ``sequence_parallel`` module lies in a decoder layer of the plan, every parameter of those
    layers belongs to a module of the plan (a replicated weight would see only its rank's tokens), no LoRA
    adapters. Returns the entries of the first and last layers."""

    def fail(message: str) -> TensorParallelError:
        return TensorParallelError(f"FSDP2 config key `tp_plan`{where}: sequence_parallel: {message}")

    modules = dict(target.named_modules())
    blocks: list[str] = []
    for path in resolved:
        block = _block_of(path, modules)
        if block is None:
            if resolved[path] == "sequence_parallel":
                raise fail(f"'{path}' is not inside a decoder layer (an element of an nn.ModuleList)")
            continue
        if block not in blocks:
            blocks.append(block)
    for block in blocks:
        for name, _ in modules[block].named_parameters():
            owner = f"{block}.{name}".rsplit(".", 1)[0]
            if ".lora_" in owner:
                raise fail(f"'{owner}' is a LoRA adapter; sequence parallelism does not place adapters")
            if owner not in resolved:
                raise fail(
                    f"'{owner}' holds parameters but has no plan entry; every module with parameters in a decoder "
                    "layer needs one (a replicated weight would see only this rank's part of the sequence)"
                )
    added: dict[str, str] = {}
    for path, style in resolved.items():
        block = _block_of(path, modules)
        if style != "colwise" or block is None:
            continue
        child = f"{block}.{path[len(block) + 1 :].split('.')[0]}"
        if child == path:
            raise fail(f"'{path}' is a column-parallel layer directly in its decoder layer; it needs a parent module")
        added[child] = SP_GATHER
    order = {path: i for i, path in enumerate(modules)}
    blocks.sort(key=order.__getitem__)
    if len(blocks) == 1:
        return {**added, blocks[0]: SP_REGION}
    return {**added, blocks[0]: SP_ENTER, blocks[-1]: SP_EXIT}


def _lora_parts(module: nn.Module) -> tuple[nn.Linear, dict[str, nn.Module], dict[str, nn.Module]] | None:
    """A PEFT LoRA layer wrapping an ``nn.Linear`` (duck-typed: the core does not import PEFT): its base layer and
    its ``lora_A`` / ``lora_B`` adapters by name; ``None`` for any other module."""
    base = getattr(module, "base_layer", None)
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if type(base) is not nn.Linear or not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        return None
    return base, dict(lora_a.items()), dict(lora_b.items())


def lora_styles(path: str, module: nn.Module, style: str) -> dict[str, str] | None:
    """The plan of a PEFT LoRA layer at ``path`` whose base layer the plan splits with ``style`` (``None``: not a
    LoRA layer). The adapters follow their base layer's placement: ``colwise``: the base layer and ``lora_B``
    split by output rows, ``lora_A`` replicated (its input is whole); ``rowwise``: the base layer and ``lora_A``
    split by input columns (``lora_A``'s output summed over the ranks), ``lora_B`` replicated. Refused: adapters on
    a layer that is not split that way, DoRA, and adapter dropout (on a column-parallel layer's whole input each
    rank would draw its own mask)."""
    parts = _lora_parts(module)
    if parts is None:
        return None
    _, lora_a, lora_b = parts

    def refuse(message: str) -> TensorParallelError:
        return TensorParallelError(f"FSDP2 config key `tensor_parallel_size`: LoRA adapters of '{path}': {message}")

    if style not in ("colwise", "rowwise"):
        raise refuse(f"the plan's style {style!r} has no adapter placement; adapt colwise or rowwise layers only")
    magnitude = getattr(module, "lora_magnitude_vector", None)
    if isinstance(magnitude, nn.ModuleDict) and len(magnitude):
        raise refuse("DoRA (`use_dora`) is not supported with tensor parallelism")
    for name, dropout in dict(getattr(module, "lora_dropout", nn.ModuleDict()).items()).items():
        if isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise refuse(f"adapter '{name}' has dropout {dropout.p}; set the LoRA `dropout` to 0")
    styles = {f"{path}.base_layer": style}
    split = lora_b if style == "colwise" else lora_a
    for name, layer in split.items():
        if type(layer) is not nn.Linear:
            raise refuse(f"adapter '{name}' is a {type(layer).__name__}, not an nn.Linear")
        styles[f"{path}.lora_{'B' if style == 'colwise' else 'A'}.{name}"] = style
    return styles


def _gather_sequence(path: str, tp_mesh: Any) -> Any:
    """A pre-hook: the module's hidden states (first positional argument, else ``hidden_states=``) gathered along
    the sequence over ``tp_mesh`` (backward: each rank keeps its part of the gradient)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gather(x: torch.Tensor) -> torch.Tensor:
        return (
            DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()]).to_local()
        )

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args and isinstance(args[0], torch.Tensor):
            return (gather(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
        raise TensorParallelError(
            f"FSDP2 config key `tp_plan`: sequence_parallel: '{path}' was called without hidden states (a tensor as "
            "its first argument or `hidden_states=`)"
        )

    return hook


def _check_sequence(path: str, tp: int) -> Any:
    def check(_: nn.Module, args: tuple[Any, ...]) -> None:
        hidden = args[0] if args else None
        if hidden is not None and (hidden.ndim < 2 or hidden.shape[1] % tp):
            raise TensorParallelError(
                f"FSDP2 config key `tp_plan`: sequence_parallel: '{path}' got hidden states of shape "
                f"{list(hidden.shape)}: the sequence (dimension 1) must divide by tensor_parallel_size {tp}; pad it"
            )

    return check


def apply_tensor_parallel(target: nn.Module, resolved: Mapping[str, str], tp_mesh: Any) -> None:
    """Split the modules of ``resolved`` (module path -> style) over ``tp_mesh`` with ``parallelize_module``
    (before ``fully_shard``): ``colwise`` -> ``ColwiseParallel``, ``rowwise`` -> ``RowwiseParallel`` (outputs
    all-reduced to whole tensors), ``replicated_with_grad_allreduce`` -> ``SequenceParallel`` over the heads
    dimension (-2): a per-head norm after a column-parallel projection, its weight replicated and its gradient
    summed over the ranks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = "sequence_parallel" in resolved.values()
    seq = Shard(1)  # the sequence dimension of [batch, sequence, hidden] between the layers

    def style_of(name: str) -> ParallelStyle:
        if name == "colwise":
            return ColwiseParallel()
        if name == "rowwise":
            return RowwiseParallel(output_layouts=seq) if sp else RowwiseParallel()
        if name == "sequence_parallel":
            return SequenceParallel(sequence_dim=1, use_local_output=True)
        if name in (SP_ENTER, SP_REGION):
            return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True)
        return SequenceParallel(sequence_dim=-2, use_local_output=True)

    exits = {path: style for path, style in resolved.items() if style in (SP_EXIT, SP_REGION)}
    for path, style in resolved.items():
        if style in (SP_ENTER, SP_REGION):  # before PrepareModuleInput's own hook: the whole input
            target.get_submodule(path).register_forward_pre_hook(_check_sequence(path, tp_mesh.size()))
    heads = {
        path for path, style in resolved.items() if style == "colwise" and is_chunked_head(target.get_submodule(path))
    }
    for path in heads:  # vocabulary-parallel: the chunked loss reads the shards itself (no input/output layouts)
        from torch.distributed.tensor import distribute_module

        distribute_module(target.get_submodule(path), tp_mesh, _shard_vocabulary(tp_mesh))
    plan = {
        path: style_of(style)
        for path, style in resolved.items()
        if style not in (SP_EXIT, SP_GATHER) and path not in heads
    }
    for path, style in resolved.items():
        if style == SP_GATHER:
            target.get_submodule(path).register_forward_pre_hook(_gather_sequence(path, tp_mesh), with_kwargs=True)
    # torch's SequenceParallel re-registers a module's parameters as new ones that require gradients, whatever the
    # old ones did (ColwiseParallel and RowwiseParallel keep it): a frozen norm (LoRA, `freeze`) would train.
    frozen = {name for name, p in target.named_parameters() if not p.requires_grad}
    parallelize_module(target, tp_mesh, plan)
    if exits:  # the last layer gathers its output: whole sequences for the final norm and the output layer
        gather = PrepareModuleOutput(output_layouts=seq, desired_output_layouts=Replicate(), use_local_output=True)
        parallelize_module(target, tp_mesh, dict.fromkeys(exits, gather))
    for name, param in target.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def plan_tensor_parallel(
    config: FSDP2Config,
    model: nn.Module,
    layout: ParallelLayout,
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
    if config.ignored_modules:
        raise TensorParallelError(
            f"FSDP2 config key `ignored_modules`{where}: not supported with tensor_parallel_size {layout.tp} yet; "
            "remove it or set tensor_parallel_size: 1"
        )
    own = config.tp_plan is None
    resolved = resolve_tp_plan(model, plan, config.source, own=own, experts=experts)
    for path, style in resolved.items():
        head = model.get_submodule(path)
        rows = getattr(head, "out_features", 0)
        if style == "colwise" and is_chunked_head(head) and rows % layout.tp:
            raise TensorParallelError(
                f"FSDP2 config key `tensor_parallel_size`{where}: {layout.tp} does not divide the vocabulary "
                f"({rows} rows of '{path}'), which the chunked loss's column-parallel output layer splits"
            )
    return tuple(resolved.items())
