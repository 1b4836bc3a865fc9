"""LoRA fine-tuning with Hugging Face PEFT: a validated :class:`LoRAConfig` (deciding), :func:`apply_lora` (doing).

The settings are MindSpeed MM's ``lora`` block:

``rank``
    The adapters' rank ``r`` (a positive integer).
``alpha``
    The scaling numerator: adapters add ``alpha / rank * B @ A`` to each target's output.
``target_modules``
    Module paths in the FSDP2 YAML's pattern syntax (``model.layers.{*}.self_attn.q_proj``). A path to an
    ``nn.Linear`` adapts it; a path to any other module adapts every ``nn.Linear`` under it. A pattern that matches
    nothing, or a module with no ``nn.Linear``, is an error naming it. As in MindSpeed MM (``lora_utils.
    is_pattern_match``, and PEFT's ``target_modules`` list), a name without braces that is not a path from the
    root (``q_proj``, ``self_attn.o_proj``) names every module whose path ends with it; those that lie under
    ``freeze`` are left out, as MindSpeed MM's Megatron route leaves out frozen targets.
``dropout``
    Dropout on the adapters' input (0 by default).
``init_lora_weights``
    PEFT's initialisations that need no base weights: ``true`` (A Kaiming-uniform, B zero: the adapted model
    starts equal to the base model), ``gaussian``, or ``false`` (PEFT's layer defaults).
``pretrained_lora_path``
    A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) to start from; its
    adapters must be exactly those this config creates (same modules, shapes and ``alpha``).
``seed``
    The seed of the adapters' random initialisation (0 by default): the initial adapters are what PEFT's
    ``inject_adapter_in_model`` creates after ``torch.manual_seed(seed)``, on every rank and whatever device the
    model is built on.

:func:`apply_lora` injects PEFT's ``lora.Linear`` layers in place (``inject_adapter_in_model``), so every module
path of the model keeps resolving (a target's own weight moves to ``<target>.base_layer.weight``), and freezes
every parameter that is not an adapter. On a model built on the meta device (inside :class:`MMFSDP2Strategy`) the
initial adapter values are written into the local shards once the model is sharded
(``FSDP2Mixin.load_after_sharding``).

Resuming checks the adapters' settings: a checkpoint records, for each adapted model, the PEFT settings that
change what the adapters compute (:data:`FUNCTION_SETTINGS`; the ``lora`` checkpoint record), and a resume (or a
validate/test/predict from the checkpoint) whose settings differ fails before any weight is read, naming the
setting with its saved and current values (:func:`check_resumed_lora`).

PEFT is imported only when LoRA is used.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn

from lightning_mm._utils.distributed import local_tensor
from lightning_mm._utils.modules import enclosing
from lightning_mm.errors import ConfigError, StateError
from lightning_mm.hf.config_fields import checked_fields
from lightning_mm.hf.pending_weights import pending_pretrained, set_pending_lora

__all__ = [
    "LoRAConfig",
    "LoRAConfigError",
    "apply_lora",
    "lora_parameter_names",
    "ADAPTER_NAME",
    "FUNCTION_SETTINGS",
    "lora_records",
    "check_resumed_lora",
]

ADAPTER_NAME = "default"
_INITS = (True, False, "gaussian")
_PEFT_PREFIX = "base_model.model."


class LoRAConfigError(ConfigError):
    """A LoRA setting that cannot be used as written."""


def _fail(key: str, message: str) -> LoRAConfigError:
    return LoRAConfigError(f"lora config `{key}`: {message}")


@dataclass
class LoRAConfig:
    """The validated ``lora`` settings (see the module docstring)."""

    target_modules: list[str] = field(default_factory=list)
    rank: int = 8
    alpha: float = 16
    dropout: float = 0.0
    init_lora_weights: bool | str = True
    pretrained_lora_path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        if (
            not isinstance(self.target_modules, (list, tuple))
            or not self.target_modules
            or not all(isinstance(p, str) and p.strip() for p in self.target_modules)
        ):
            raise _fail(
                "target_modules", f"expected a non-empty list of module path patterns, got {self.target_modules!r}"
            )
        self.target_modules = [p.strip() for p in self.target_modules]
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise _fail("rank", f"expected a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise _fail("alpha", f"expected a positive number, got {self.alpha!r}")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= self.dropout < 1.0
        ):
            raise _fail("dropout", f"expected a probability in [0, 1), got {self.dropout!r}")
        init = self.init_lora_weights
        if isinstance(init, str) and init.lower() in ("true", "false"):
            init = init.lower() == "true"
        if isinstance(init, str):
            init = init.lower()
        if init not in _INITS or (isinstance(init, int) and not isinstance(init, bool)):
            raise _fail("init_lora_weights", f"expected true, false or 'gaussian', got {self.init_lora_weights!r}")
        self.init_lora_weights = init
        if self.pretrained_lora_path is not None:
            path = Path(str(self.pretrained_lora_path)).expanduser()
            if not (path / "adapter_config.json").is_file():
                raise _fail(
                    "pretrained_lora_path", f"'{path}' has no adapter_config.json (not a PEFT adapter directory)"
                )
            if not (path / "adapter_model.safetensors").is_file():
                raise _fail("pretrained_lora_path", f"'{path}' has no adapter_model.safetensors")
            self.pretrained_lora_path = str(path)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise _fail("seed", f"expected an integer, got {self.seed!r}")

    @classmethod
    def from_any(cls, config: Any) -> LoRAConfig:
        """Accept a LoRAConfig, a mapping, or an object whose attributes are the keys (MindSpeed MM's namespaces)."""
        if isinstance(config, cls):
            return config
        data = checked_fields(config, cls, "lora", LoRAConfigError)
        if "target_modules" not in data:
            raise _fail("target_modules", "is required (the module paths that get adapters)")
        return cls(**data)

    def peft_config(self, targets: list[str]) -> Any:
        """PEFT's ``LoraConfig`` for the resolved target paths."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            # PEFT annotates `lora_alpha` as an int; it only divides it by the rank, so a float alpha works.
            lora_alpha=self.alpha,  # type: ignore[arg-type]
            lora_dropout=float(self.dropout),
            target_modules=list(targets),
            init_lora_weights=cast("bool | Literal['gaussian']", self.init_lora_weights),  # one of _INITS
            bias="none",
        )


# -------------------------------------------------------------------------------------- deciding
def resolve_targets(model: nn.Module, config: LoRAConfig, frozen: Sequence[str] = ()) -> list[str]:
    """The paths of the ``nn.Linear`` modules that get adapters; every problem is a :class:`LoRAConfigError`."""
    from lightning_mm.core.patterns import PatternError, resolve_patterns

    paths: list[str] = []
    for pattern in config.target_modules:
        try:
            paths += resolve_patterns(model, [pattern], "lora.target_modules")
        except PatternError as err:
            found = _suffix_matches(model, pattern)
            if not found:
                raise LoRAConfigError(f"lora config {err}") from None
            found = [p for p in found if enclosing(p, frozen) is None]
            if not found:
                raise _fail("target_modules", f"every module named '{pattern}' lies under `freeze`") from None
            paths += found
    targets: dict[str, None] = {}
    for path in dict.fromkeys(paths):
        module = model.get_submodule(path)
        found = (
            [path]
            if isinstance(module, nn.Linear)
            else [
                f"{path}.{name}" if path else name
                for name, m in module.named_modules()
                if isinstance(m, nn.Linear) and name
            ]
        )
        if not found:
            raise _fail(
                "target_modules",
                f"'{path}' ({type(module).__name__}) is not an nn.Linear and holds none; LoRA adapts linear layers",
            )
        for target in found:
            under = enclosing(target, frozen)
            if under is not None:
                raise _fail(
                    "target_modules",
                    f"'{target}' lies under '{under}', which `freeze` freezes; remove it from one of the two",
                )
            targets[target] = None
    # In the model's module order, the order PEFT visits them in (and so draws their random values in).
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(targets, key=order.__getitem__)


def _suffix_matches(model: nn.Module, pattern: str) -> list[str]:
    """MindSpeed MM's rule for a target without braces: every module whose path is ``pattern`` or ends with it."""
    if "{" in pattern or "}" in pattern:
        return []
    return [name for name, _ in model.named_modules() if name and (name == pattern or name.endswith("." + pattern))]


def lora_parameter_names(model: nn.Module) -> list[str]:
    """Names of the adapter parameters (``...lora_A.default.weight``) in ``model``."""
    return [n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


# -------------------------------------------------------------------------------------- doing
@dataclass(frozen=True)
class _Target:
    """What PEFT needs to know of one target to create its adapters."""

    path: str
    in_features: int
    out_features: int
    dtype: torch.dtype


def _describe_targets(model: nn.Module, targets: list[str]) -> list[_Target]:
    out = []
    for path in targets:
        linear = cast(nn.Linear, model.get_submodule(path))  # resolve_targets: nn.Linear modules
        weight = getattr(linear, "weight", None)
        dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.get_default_dtype()
        out.append(_Target(path, linear.in_features, linear.out_features, dtype))
    return out


def _skeleton(targets: list[_Target]) -> nn.Module:
    """A module tree holding only the targets, at their paths, as ``nn.Linear`` shells without storage."""
    root = nn.Module()
    for target in targets:
        parent = root
        parts = target.path.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        shell = nn.Linear(1, 1, bias=False, device="meta")
        shell.in_features, shell.out_features = target.in_features, target.out_features
        # A real CPU weight (so PEFT keeps its adapters on the CPU) that owns one element of memory.
        shell.weight = nn.Parameter(torch.zeros(1, dtype=target.dtype).expand(target.out_features, target.in_features))
        parent.add_module(parts[-1], shell)
    return root


def initial_adapters(config: LoRAConfig, targets: list[_Target]) -> dict[str, torch.Tensor]:
    """The adapters PEFT creates for ``targets`` after ``torch.manual_seed(config.seed)``, as full CPU tensors.

    PEFT itself initialises them, on a skeleton of the targets (so base weights are neither needed nor touched),
    in the order ``inject_adapter_in_model`` visits them on the model; the global RNG state is left as it was.
    Call it outside the meta-device context (parameters registered there become meta tensors).
    """
    from peft import inject_adapter_in_model

    skeleton = _skeleton(targets)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        inject_adapter_in_model(config.peft_config([t.path for t in targets]), skeleton, adapter_name=ADAPTER_NAME)
    values = {n: p.detach().clone() for n, p in skeleton.named_parameters() if ".lora_" in n}
    if any(v.is_meta for v in values.values()):
        raise StateError("initial_adapters() ran inside a meta-device context; call it outside")
    return values


def read_pretrained_adapters(
    path: str, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]], config: LoRAConfig
) -> dict[str, torch.Tensor]:
    """The adapters saved in PEFT's format at ``path``, checked against the ``(shape, dtype)`` of the model's."""
    from safetensors.torch import load_file

    saved = json.loads((Path(path) / "adapter_config.json").read_text())
    where = f"lora config `pretrained_lora_path` ('{path}')"
    if saved.get("peft_type", "LORA") != "LORA":
        raise LoRAConfigError(f"{where}: holds {saved.get('peft_type')} adapters, not LoRA")
    if saved.get("r") is not None and int(saved["r"]) != config.rank:
        raise LoRAConfigError(f"{where}: saved with rank {saved['r']}, but `rank` is {config.rank}")
    if saved.get("lora_alpha") is not None and float(saved["lora_alpha"]) != float(config.alpha):
        raise LoRAConfigError(f"{where}: saved with alpha {saved['lora_alpha']}, but `alpha` is {config.alpha}")
    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(part, f"{part}{ADAPTER_NAME}.")
        if name not in expected:
            unknown.append(key)
            continue
        shape, dtype = expected[name]
        if tuple(value.shape) != tuple(shape):
            raise LoRAConfigError(
                f"{where}: '{key}' has shape {list(value.shape)}, this model's adapter needs "
                f"{list(shape)}; the adapters were trained on another base model"
            )
        out[name] = value.to(dtype)
    if unknown:
        raise LoRAConfigError(
            f"{where}: {len(unknown)} saved adapter(s) adapt modules that this model lacks or "
            f"`target_modules` does not name, e.g. {unknown[:3]}; the adapters were trained on "
            "another base model or with other target_modules"
        )
    missing = [n for n in expected if n not in out]
    if missing:
        raise LoRAConfigError(
            f"{where}: no saved values for {len(missing)} adapter(s) of `target_modules`, e.g. {missing[:3]}"
        )
    return out


def _copy_into(model: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Write full ``values`` into ``model``'s parameters (each rank only its own region of a DTensor)."""

    from lightning_mm.hf.loading import local_region

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            param = params[name]
            offsets, sizes = local_region(param)
            region = value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            local = local_tensor(param)
            local.copy_(region.to(local.dtype))


class PendingLoRA:
    """Adapter values for a model built on the meta device, written once the model is sharded.

    Either the values read from ``pretrained_lora_path``, or PEFT's initialisation, computed then (outside the
    meta-device context) identically on every rank.
    """

    def __init__(self, config: LoRAConfig, targets: list[_Target], values: dict[str, torch.Tensor] | None) -> None:
        self.config, self.targets, self.values = config, targets, values

    def load_after_sharding(self, model: nn.Module) -> None:
        values = self.values if self.values is not None else initial_adapters(self.config, self.targets)
        _copy_into(model, values)
        set_pending_lora(model, None)


def _rename_pending_plan(model: nn.Module, targets: list[str]) -> None:
    """A deferred pretrained load names a target's weight ``<t>.weight``; it is ``<t>.base_layer.<...>`` now."""
    pending = pending_pretrained(model)
    if pending is None:
        return
    prefixes = tuple(t + "." for t in targets)

    def rename(name: str) -> str:
        for prefix in prefixes:
            if name.startswith(prefix) and not name.startswith(prefix + "base_layer."):
                return prefix + "base_layer." + name[len(prefix) :]
        return name

    entries = tuple(dataclasses.replace(e, names=tuple(rename(n) for n in e.names)) for e in pending.plan.entries)
    pending.plan = dataclasses.replace(pending.plan, entries=entries)


def apply_lora(model: nn.Module, config: Any, frozen: Sequence[str] = ()) -> nn.Module:
    """Add LoRA adapters to ``model`` in place (PEFT's ``inject_adapter_in_model``) and freeze everything else.

    ``config`` is a :class:`LoRAConfig` or its mapping; ``frozen`` lists module paths that ``freeze`` froze (an
    adapter under one of them is an error). Call it before sharding (in ``model_provider``). The model gets a
    ``peft_config`` attribute (PEFT's ``LoraConfig``), which the checkpoint records for ``dcp-to-hf
    --merge-lora``. Returns ``model``.
    """
    from peft import inject_adapter_in_model

    cfg = LoRAConfig.from_any(config)
    if getattr(model, "peft_config", None) is not None:
        raise LoRAConfigError(f"{type(model).__name__} has adapters already (a `peft_config` attribute)")
    paths = resolve_targets(model, cfg, list(frozen))
    targets = _describe_targets(model, paths)
    for param in model.parameters():
        param.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # the values are written below: leave the caller's RNG alone
        inject_adapter_in_model(cfg.peft_config(paths), model, adapter_name=ADAPTER_NAME)
    params = dict(model.named_parameters())
    expected = {n: (tuple(params[n].shape), params[n].dtype) for n in lora_parameter_names(model)}
    values = None
    if cfg.pretrained_lora_path is not None:
        values = read_pretrained_adapters(cfg.pretrained_lora_path, expected, cfg)
    _rename_pending_plan(model, paths)
    pending = PendingLoRA(cfg, targets, values)
    if any(p.is_meta for p in model.parameters()):
        if not callable(getattr(model, "load_after_sharding", None)):
            raise LoRAConfigError(
                f"{type(model).__name__} is built on the meta device, so its adapters get their values after "
                "sharding in `load_after_sharding()`: declare it with lightning_mm.modules.FSDP2Mixin"
            )
        set_pending_lora(model, pending)
    else:
        pending.load_after_sharding(model)
    return model


# -------------------------------------------------------------------------------------- resuming
FUNCTION_SETTINGS: dict[str, str] = {
    "r": "rank",
    "lora_alpha": "alpha",
    "target_modules": "target_modules",
    "target_parameters": "target_parameters",
    "exclude_modules": "exclude_modules",
    "use_rslora": "use_rslora",
    "use_dora": "use_dora",
    "use_bdlora": "use_bdlora",
    "use_qalora": "use_qalora",
    "qalora_group_size": "qalora_group_size",
    "bias": "bias",
    "lora_bias": "lora_bias",
    "fan_in_fan_out": "fan_in_fan_out",
    "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern",
    "layers_to_transform": "layers_to_transform",
    "layers_pattern": "layers_pattern",
    "layer_replication": "layer_replication",
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "alora_invocation_tokens",
    "arrow_config": "arrow_config",
    "kasa_config": "kasa_config",
    "monteclora_config": "monteclora_config",
    "velora_config": "velora_config",
}
"""PEFT ``LoraConfig`` fields that change the function the adapted model computes from the same weights, and the
name a message gives each (this project's ``lora`` key where it has one: ``rank``, ``alpha``). Resuming with any
of them changed is refused. Not among them: ``lora_dropout`` (dropout changes the noise of training steps only;
the function evaluated from the weights is the same, and changing it between runs is a legitimate schedule),
``init_lora_weights`` and the initialisation configs (``loftq_config``, ``eva_config``, ``corda_config``,
``lora_ga_config``: a resume reads the values), ``seed``, and bookkeeping (``task_type``, ``inference_mode``,
``base_model_name_or_path``, ``revision``, ``peft_version``, the Megatron layer settings)."""

_RECORD = "lora"  # the checkpoint record's name (``lightning_mm.checkpoint.record_providers``)


def lora_records(root: nn.Module) -> dict[str, dict[str, Any]]:
    """``{module path: its adapters' FUNCTION_SETTINGS}`` for every top-most module with LoRA adapters (a
    ``peft_config``), as JSON-able data: what a checkpoint records to check a resume (``{}`` without adapters)."""
    from lightning_mm.hf.checkpoint_records import lora_record

    out: dict[str, dict[str, Any]] = {}
    for name, module in root.named_modules():
        if enclosing(name, list(out)) is not None:
            continue
        record = lora_record(module)
        if record is not None:
            out[name] = {key: record[key] for key in FUNCTION_SETTINGS if key in record}
    return out


def _hf_lora(records: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The adapters' settings of a checkpoint written before the ``lora`` record, from its ``hf`` record."""
    out = {}
    for record in records.get("hf") or []:
        if isinstance(record, Mapping) and isinstance(record.get("lora"), Mapping):
            out[str(record.get("prefix", "")).removesuffix(".")] = dict(record["lora"])
    return out


def _same_setting(saved: Any, now: Any) -> bool:
    numbers = (int, float)
    if (
        isinstance(saved, numbers)
        and isinstance(now, numbers)
        and not isinstance(saved, bool)
        and not isinstance(now, bool)
    ):
        return float(saved) == float(now)
    if isinstance(saved, (list, tuple)) and isinstance(now, (list, tuple)):
        return len(saved) == len(now) and all(_same_setting(a, b) for a, b in zip(saved, now))
    if isinstance(saved, Mapping) and isinstance(now, Mapping):
        return saved.keys() == now.keys() and all(_same_setting(saved[k], now[k]) for k in saved)
    return saved == now


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 200 else text[:197] + "..."


def check_resumed_lora(records: Mapping[str, Any], root: nn.Module, where: str) -> None:
    """Refuse to load a checkpoint into ``root`` when an adapted module's :data:`FUNCTION_SETTINGS` differ from the
    ones the checkpoint records (``records``: its record entries); a :class:`LoRAConfigError` naming the setting,
    the saved and the current value. Adapters present on one side only are left to the key checks."""
    saved_all = records.get(_RECORD)
    saved_all = dict(saved_all) if isinstance(saved_all, Mapping) else _hf_lora(records)
    if not saved_all:
        return
    current_all = lora_records(root)
    for path, saved in saved_all.items():
        current = current_all.get(path)
        if current is None or not isinstance(saved, Mapping):
            continue
        for key, name in FUNCTION_SETTINGS.items():
            if key in saved and key in current and not _same_setting(saved[key], current[key]):
                module = f" of `{path}`" if path else ""
                raise LoRAConfigError(
                    f"{where}: the checkpoint's LoRA adapters{module} were trained with {name} {_shown(saved[key])}, "
                    f"the model now has {name} {_shown(current[key])}; loading them would change what they compute. "
                    f"Set lora `{name}` back to {_shown(saved[key])} to resume, or start new adapters"
                )
