"""``DiffusersModel(config)``: build an adapted diffusers model, as ``TransformersModel`` builds a Transformers one.

The config (a dict, or an object whose attributes are the keys) has these keys:

``model_id``
    The :class:`~lightning_mm.diffusers.diffusers_hub.DiffusersHub` key (optional: else the config's ``_class_name``).
``init_from_path``
    A diffusers ``save_pretrained`` directory of the model (``config.json`` and ``diffusion_pytorch_model``
    safetensors): its config and weights are loaded (strictly).
``config``
    Keys that override the directory's config, or the whole config when there is no path (then with
    ``model_id``); without a path the weights are initialised as the constructor does.
``freeze``
    Module paths (FSDP2 YAML pattern syntax) whose parameters get ``requires_grad=False``.
``trainable``
    Module paths (the same syntax) that alone train: every parameter outside them gets ``requires_grad=False``
    (Wan VACE's recipe: ``[vace_patch_embedding, vace_blocks]``, the Wan blocks frozen). Not together with
    ``freeze`` or ``lora``.
``lora``
    LoRA fine-tuning with PEFT, the keys of :mod:`lightning_mm.hf.lora` (``rank``, ``alpha``, ``target_modules``
    as diffusers module paths such as ``blocks.{*}.attn1.to_q``, ``dropout``, ``init_lora_weights``,
    ``pretrained_lora_path``, ``seed``): adapters are added after ``freeze`` (PEFT's ``inject_adapter_in_model``)
    and every other parameter is frozen, as for a Transformers model.

Built inside :class:`~lightning_mm.MMFSDP2Strategy`'s model-building context, parameters are on the meta device:
the checkpoint is checked against the model right away (headers only) and each rank reads just its own shards
once the model is sharded (``FSDP2Mixin.load_after_sharding``). Built anywhere else, the weights are read straight
into the model. Parameters take the default dtype; mixed precision is FSDP2's job.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_mm._utils.suggestions import did_you_mean
from lightning_mm.diffusers.diffusers_hub import DiffusersHub
from lightning_mm.diffusers.weights import diffusers_load_plan, read_diffusers_weights
from lightning_mm.errors import ConfigError
from lightning_mm.hf.config_fields import checked_fields
from lightning_mm.hf.loading import load_into_meta_model
from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin
from lightning_mm.hf.pending_weights import set_pending_pretrained
from lightning_mm.hf.transformers_model import PendingPretrained

__all__ = ["DiffusersModel", "DiffusersModelConfig", "DiffusersModelConfigError", "read_diffusers_config"]

log = logging.getLogger(__name__)


class DiffusersModelConfigError(ConfigError):
    """A DiffusersModel config that cannot be used as written."""


@dataclass
class DiffusersModelConfig:
    """The validated config of :func:`DiffusersModel`."""

    model_id: str | None = None
    init_from_path: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    freeze: list[str] = field(default_factory=list)
    trainable: list[str] = field(default_factory=list)
    lora: Any = None

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> DiffusersModelConfigError:
            return DiffusersModelConfigError(f"DiffusersModel config `{key}`: {message}")

        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id.strip()):
            raise fail("model_id", f"expected a non-empty string, got {self.model_id!r}")
        if self.init_from_path is not None:
            if not isinstance(self.init_from_path, (str, os.PathLike)):
                raise fail("init_from_path", f"expected a directory path, got {self.init_from_path!r}")
            path = Path(self.init_from_path).expanduser()
            if not (path / "config.json").is_file():
                raise fail("init_from_path", f"'{path}' is not a diffusers model directory (no config.json)")
            self.init_from_path = str(path)
        if self.config is None:
            self.config = {}
        if not isinstance(self.config, Mapping):
            raise fail("config", f"expected a mapping of config keys, got {type(self.config).__name__}")
        self.config = dict(self.config)
        if isinstance(self.freeze, str):
            self.freeze = [self.freeze]
        if not isinstance(self.freeze, (list, tuple)) or not all(isinstance(p, str) and p.strip() for p in self.freeze):
            raise fail("freeze", f"expected a list of module path patterns, got {self.freeze!r}")
        if isinstance(self.trainable, str):
            self.trainable = [self.trainable]
        if not isinstance(self.trainable, (list, tuple)) or not all(
            isinstance(p, str) and p.strip() for p in self.trainable
        ):
            raise fail("trainable", f"expected a list of module path patterns, got {self.trainable!r}")
        if self.trainable and (self.freeze or self.lora is not None):
            raise fail("trainable", "give either `trainable` (all else frozen) or `freeze` / `lora`, not both")
        if self.lora is not None:  # checked now, before any model is built
            from lightning_mm.hf.lora import LoRAConfig

            self.lora = LoRAConfig.from_any(self.lora)  # a LoRAConfigError names the `lora` key
        if self.init_from_path is None and self.model_id is None and not self.config.get("_class_name"):
            raise fail("model_id", "give `init_from_path` (a diffusers model directory), or `config` with `model_id`")

    @classmethod
    def from_any(cls, config: Any) -> DiffusersModelConfig:
        if isinstance(config, cls):
            return config
        return cls(**checked_fields(config, cls, "DiffusersModel", DiffusersModelConfigError))


def read_diffusers_config(directory: str | Path) -> dict[str, Any]:
    """A diffusers ``config.json`` as a dict; anything but a JSON object is an error naming the file."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DiffusersModelConfigError(f"{path}: not a readable JSON config ({err})") from None
    if not isinstance(data, dict):
        raise DiffusersModelConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _init_keys(model_cls: type[Any]) -> list[str]:
    return [n for n in inspect.signature(model_cls.__init__).parameters if n not in ("self", "args", "kwargs")]


def build_config(cfg: DiffusersModelConfig, model_cls: type, base: dict[str, Any]) -> dict[str, Any]:
    """The model's constructor arguments: ``base`` (the directory's config) updated by ``cfg.config``; a key the
    class does not take is an error (a typo would otherwise be dropped by diffusers with a warning)."""
    known = _init_keys(model_cls)
    out = {k: v for k, v in base.items() if not k.startswith("_")}
    for key, value in cfg.config.items():
        if key.startswith("_"):
            continue
        if key not in known:
            raise DiffusersModelConfigError(
                f"DiffusersModel config `config.{key}`: {model_cls.__name__} has no such argument"
                + did_you_mean(key, known)
            )
        out[key] = value
    unknown = sorted(k for k in out if k not in known)
    if unknown:
        raise DiffusersModelConfigError(
            f"{cfg.init_from_path}/config.json: {model_cls.__name__} has no argument(s) {unknown}"
        )
    return out


def _meta_parameters_active() -> bool:
    probe = nn.Module()
    probe.register_parameter("probe", nn.Parameter(torch.empty(0)))
    return probe.get_parameter("probe").is_meta


def _freeze(model: nn.Module, patterns: list[str]) -> None:
    from lightning_mm.core.patterns import PatternError, resolve_patterns

    try:
        paths = resolve_patterns(model, patterns, "freeze")
    except PatternError as err:
        raise DiffusersModelConfigError(f"DiffusersModel config {err}") from None
    for path in paths:
        model.get_submodule(path).requires_grad_(False)


def _train_only(model: nn.Module, patterns: list[str]) -> None:
    """Freeze every parameter outside the modules ``patterns`` resolve to."""
    from lightning_mm.core.patterns import PatternError, resolve_patterns

    try:
        paths = resolve_patterns(model, patterns, "trainable")
    except PatternError as err:
        raise DiffusersModelConfigError(f"DiffusersModel config {err}") from None
    model.requires_grad_(False)
    for path in paths:
        model.get_submodule(path).requires_grad_(True)


def DiffusersModel(config: Any) -> nn.Module:  # noqa: N802 - a factory named like TransformersModel
    """Build the adapted diffusers model ``config`` describes (see the module docstring for the keys).

    Returns an instance of the class registered in :class:`DiffusersHub` (a diffusers ``ModelMixin`` subclass with
    ``FSDP2Mixin`` and ``WeightInitMixin``): module paths and state-dict keys are diffusers' own.
    """
    cfg = DiffusersModelConfig.from_any(config)
    base = read_diffusers_config(cfg.init_from_path) if cfg.init_from_path else {}
    key, model_cls = DiffusersHub.resolve_diffusers(cfg.model_id, {**cfg.config, **base})
    missing = [m.__name__ for m in (FSDP2Mixin, WeightInitMixin) if not issubclass(model_cls, m)]
    if missing:
        raise DiffusersModelConfigError(
            f"DiffusersHub key '{key}' maps to {model_cls.__name__}, which lacks {', '.join(missing)}"
        )
    if torch.empty(0).is_meta:
        raise DiffusersModelConfigError(
            "DiffusersModel cannot be built under torch.device('meta'): it would lose computed buffers such as the "
            "rotary tables. Use MMFSDP2Strategy (parameters alone go to the meta device) or build it eagerly"
        )
    kwargs = build_config(cfg, model_cls, base)
    index = read_diffusers_weights(cfg.init_from_path) if cfg.init_from_path else None
    if index is None:
        model = model_cls(**kwargs)
    elif _meta_parameters_active():
        model = model_cls(**kwargs)
        set_pending_pretrained(model, PendingPretrained(model, diffusers_load_plan(model, index)))
    else:
        from lightning_mm.core.init_context import meta_parameters

        with meta_parameters():
            model = model_cls(**kwargs)
        load_into_meta_model(model, diffusers_load_plan(model, index))
    if cfg.freeze:
        _freeze(model, cfg.freeze)
    if cfg.trainable:
        _train_only(model, cfg.trainable)
    if cfg.lora is not None:
        from lightning_mm.hf.lora import apply_lora

        apply_lora(model, cfg.lora, cfg.freeze)
    log.info(
        "DiffusersModel: %s (key '%s')%s",
        model_cls.__name__,
        key,
        f" from {cfg.init_from_path}" if cfg.init_from_path else ", initialised as constructed",
    )
    return model
