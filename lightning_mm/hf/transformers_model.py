"""``TransformersModel(config)``: build an adapted Hugging Face model, as MindSpeed MM's ``model_provider`` does.

The config (a dict, or an object with attributes such as MindSpeed MM's ``args.mm.model``) has these keys:

``model_id``
    The ModelHub key of the adapter (optional: else the Hugging Face config's ``architectures[0]``, else its
    ``model_type``). An architecture no adapter is registered for is built as its Transformers class plus the
    mixins, with a default plan derived from the model's metadata (:mod:`lightning_mm.hf.derived_adapters`):
    ``model_id`` may then name the Transformers class.
``init_from_hf_path``
    A local Hugging Face directory: its ``config.json`` and its safetensors weights are loaded (strictly).
``hf_config``
    A dict that overrides the directory's config (nested dicts update sub-configs such as ``text_config``), or
    defines the whole config when there is no path (then with ``model_type``, or with ``model_id``); without a
    path the weights are randomly initialised. ``attn_implementation`` is accepted too.
``freeze``
    Module paths whose parameters get ``requires_grad=False``, in the FSDP2 YAML's pattern syntax
    (``model.vision_tower``, ``model.language_model.layers.{0-3}``).
``lora``
    LoRA fine-tuning with PEFT (``rank``, ``alpha``, ``target_modules``, ``dropout``, ``init_lora_weights``,
    ``pretrained_lora_path``): see :mod:`lightning_mm.hf.lora`. Adapters are added after ``freeze``, before
    sharding; every other parameter is frozen.
``trust_remote_code``
    ``False`` by default; only ``true`` lets Transformers run code that comes with a checkpoint (it is always
    passed explicitly, so Transformers never stops to ask on a terminal).
``enable_chunk_loss``, ``chunk_loss_size``
    ``true``: a call with ``labels`` computes its cross-entropy ``chunk_loss_size`` tokens at a time (default
    1024) from the final hidden states and the output layer's weight, with no ``[tokens, vocab]`` logits (the
    output's ``logits`` is then ``None``); loss and gradients equal the model's own loss. MindSpeed MM's
    ``features.enable_chunk_loss`` / ``chunkloss_plan.chunk_size``. See :mod:`lightning_mm.hf.chunk_loss`.

Built inside :class:`~lightning_mm.MMFSDP2Strategy`'s ``model_provider`` context (or ``lightning-mm plan``'s),
parameters are on the meta device, and none is ever allocated: the model is built under ``torch.device("meta")``
and its buffers are then computed by its own init rules, as ``from_pretrained`` does
(:mod:`lightning_mm.hf.meta_build`). The checkpoint is checked against the model right away (headers only), and
each rank reads just its own shards once the strategy has sharded the model (``FSDP2Mixin.load_after_sharding``).
Built anywhere else, the weights are read straight into the model (built the same way, so no parameter is
allocated twice). Parameters take the default dtype (fp32 unless the Trainer's
precision says otherwise), whatever dtype the checkpoint or its config names; mixed precision is FSDP2's job.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lightning_mm._compat import set_attn_implementation
from lightning_mm._utils.model_files import model_file
from lightning_mm._utils.modules import enclosing
from lightning_mm._utils.suggestions import did_you_mean
from lightning_mm.errors import ConfigError, StateError
from lightning_mm.hf.batch_check import install_batch_check
from lightning_mm.hf.config_fields import checked_fields
from lightning_mm.hf.derived_adapters import resolve_model_class
from lightning_mm.hf.loading import load_into_meta_model, load_local_shards
from lightning_mm.hf.meta_build import build_on_meta
from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin
from lightning_mm.hf.packed_inputs import install_packed_inputs
from lightning_mm.hf.pending_weights import set_pending_pretrained
from lightning_mm.hf.pretrained_index import LoadPlan, SafetensorsIndex, build_load_plan

__all__ = ["TransformersModel", "TransformersModelConfig", "TransformersModelConfigError", "PendingPretrained"]

log = logging.getLogger(__name__)


class TransformersModelConfigError(ConfigError):
    """A TransformersModel config that cannot be used as written."""


@dataclass
class TransformersModelConfig:
    """The validated config of :func:`TransformersModel`."""

    model_id: str | None = None
    init_from_hf_path: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict)
    freeze: list[str] = field(default_factory=list)
    trust_remote_code: bool = False
    lora: Any = None
    enable_chunk_loss: bool = False
    """Compute the loss in chunks of ``chunk_loss_size`` tokens, without the ``[tokens, vocab]`` logits."""
    chunk_loss_size: int = 1024
    """Tokens per chunk of the chunked loss (``enable_chunk_loss``)."""

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> TransformersModelConfigError:
            return TransformersModelConfigError(f"TransformersModel config `{key}`: {message}")

        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id.strip()):
            raise fail("model_id", f"expected a non-empty string, got {self.model_id!r}")
        if self.init_from_hf_path is not None:
            if not isinstance(self.init_from_hf_path, (str, os.PathLike)):
                raise fail("init_from_hf_path", f"expected a directory path, got {self.init_from_hf_path!r}")
            path = Path(self.init_from_hf_path).expanduser()
            if not path.is_dir():
                raise fail("init_from_hf_path", f"'{path}' is not a directory")
            if not (path / "config.json").is_file() and not (path / "config.json").is_symlink():
                raise fail("init_from_hf_path", f"'{path}' has no config.json (not a Hugging Face model directory)")
            try:
                model_file(path, "config.json")
            except ValueError as err:
                raise fail("init_from_hf_path", str(err)) from None
            self.init_from_hf_path = str(path)
        self.hf_config = _plain(self.hf_config) if self.hf_config is not None else {}
        if not isinstance(self.hf_config, Mapping):
            raise fail("hf_config", f"expected a mapping of config keys, got {type(self.hf_config).__name__}")
        if isinstance(self.freeze, str):
            self.freeze = [self.freeze]
        if self.freeze is None:
            self.freeze = []
        if not isinstance(self.freeze, (list, tuple)) or not all(isinstance(p, str) and p.strip() for p in self.freeze):
            raise fail("freeze", f"expected a list of module path patterns, got {self.freeze!r}")
        self.freeze = [p.strip() for p in self.freeze]
        if not isinstance(self.trust_remote_code, bool):
            raise fail("trust_remote_code", f"expected true or false, got {self.trust_remote_code!r}")
        if not isinstance(self.enable_chunk_loss, bool):
            raise fail("enable_chunk_loss", f"expected true or false, got {self.enable_chunk_loss!r}")
        if (
            isinstance(self.chunk_loss_size, bool)
            or not isinstance(self.chunk_loss_size, int)
            or self.chunk_loss_size <= 0
        ):
            raise fail("chunk_loss_size", f"expected a positive number of tokens, got {self.chunk_loss_size!r}")
        if self.lora is not None:  # checked now, before any model is built
            from lightning_mm.hf.lora import LoRAConfig

            self.lora = LoRAConfig.from_any(_plain(self.lora))

    @classmethod
    def from_any(cls, config: Any) -> TransformersModelConfig:
        """Accept a TransformersModelConfig, a mapping, or an object whose attributes are the keys."""
        if isinstance(config, cls):
            return config
        data = checked_fields(config, cls, "TransformersModel", TransformersModelConfigError)
        return cls(**data)


def _plain(value: Any) -> Any:
    """Mappings and namespaces (argparse's, jsonargparse's, SimpleNamespace) as plain dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (argparse.Namespace, SimpleNamespace)):
        return {k: _plain(v) for k, v in vars(value).items() if not k.startswith("__")}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


# ------------------------------------------------------------------------------------------ the HF config
_SPECIAL_KEYS = ("attn_implementation",)


def _check_keys(config: Any, overrides: Mapping[str, Any], where: str) -> None:
    """Every override key must be a key of ``config``: a typo would otherwise become a silent new attribute."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}) or {})
    for key, value in overrides.items():
        if key in _SPECIAL_KEYS:
            continue
        if not isinstance(key, str) or (key not in known and not hasattr(config, key)):
            raise TransformersModelConfigError(
                f"TransformersModel config `{where}.{key}`: {type(config).__name__} has no such key"
                + did_you_mean(key, sorted(known))
            )
        sub = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(sub, PretrainedConfig):
            model_type = value.get("model_type", sub.model_type)
            if model_type != sub.model_type:
                if model_type not in CONFIG_MAPPING:
                    raise TransformersModelConfigError(
                        f"TransformersModel config `{where}.{key}.model_type`: unknown model_type '{model_type}'"
                    )
                sub = CONFIG_MAPPING[model_type]()
            _check_keys(sub, {k: v for k, v in value.items() if k != "model_type"}, f"{where}.{key}")


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``overrides``; a nested dict updates a sub-config of the same ``model_type``."""
    out = dict(base)
    for key, value in overrides.items():
        current = out.get(key)
        if (
            isinstance(current, Mapping)
            and isinstance(value, Mapping)
            and value.get("model_type", current.get("model_type")) == current.get("model_type")
        ):
            out[key] = _merge(current, value)
        else:
            out[key] = value
    return out


def build_hf_config(cfg: TransformersModelConfig) -> Any:
    """The Hugging Face config: the directory's (plus overrides), or one defined by ``hf_config`` alone."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # Always explicit: left unset, Transformers may stop and ask on a terminal whether to run a checkpoint's code.
    remote = {"trust_remote_code": cfg.trust_remote_code}
    overrides = dict(cfg.hf_config)
    attn = overrides.pop("attn_implementation", None)
    if cfg.init_from_hf_path is not None:
        base = AutoConfig.from_pretrained(cfg.init_from_hf_path, **remote)
        if overrides:
            _check_keys(base, overrides, "hf_config")
            base = type(base).from_dict(_merge(base.to_dict(), overrides))
        config = base
    else:
        model_type = overrides.pop("model_type", None)
        if model_type is not None:
            if model_type not in CONFIG_MAPPING:
                raise TransformersModelConfigError(
                    f"TransformersModel config `hf_config.model_type`: unknown model_type '{model_type}'"
                    + did_you_mean(model_type, CONFIG_MAPPING.keys())
                )
            config_cls = CONFIG_MAPPING[model_type]
        elif cfg.model_id is not None:
            model_cls: Any = resolve_model_class(cfg.model_id)[1]  # a PreTrainedModel subclass
            config_cls = model_cls.config_class
        else:
            raise TransformersModelConfigError(
                "TransformersModel config: give `init_from_hf_path` (a Hugging Face directory), or `hf_config` "
                "with a `model_type`, or a `model_id` whose adapter defines the config class"
            )
        _check_keys(config_cls(), overrides, "hf_config")
        config = config_cls(**overrides)
    if attn is not None:
        set_attn_implementation(config, attn)
    return config


# ----------------------------------------------------------------------------------- deferred loading
def _meta_parameters_active() -> bool:
    """Whether parameters registered now go to the meta device (MMFSDP2Strategy's model-building context)."""
    probe = nn.Module()
    probe.register_parameter("probe", nn.Parameter(torch.empty(0)))
    return probe.get_parameter("probe").is_meta


class PendingPretrained:
    """Pretrained weights that a model built on the meta device reads once it is sharded.

    Until then the model refuses to run forward, so a strategy that never calls ``load_after_sharding`` cannot
    silently train from empty weights.
    """

    def __init__(self, model: nn.Module, plan: LoadPlan) -> None:
        self.plan = plan
        self._guard = model.register_forward_pre_hook(self._refuse)

    def _refuse(self, module: nn.Module, *_: Any) -> None:
        raise StateError(
            f"{type(module).__name__} was built on the meta device and its pretrained weights from "
            f"{self.plan.directory} were never loaded: the strategy must call `load_after_sharding()` after "
            "sharding (MMFSDP2Strategy does), or build the model outside the meta-device context"
        )

    def load_after_sharding(self, model: nn.Module) -> None:
        count = load_local_shards(model, self.plan)
        self._guard.remove()
        set_pending_pretrained(model, None)
        log.info("loaded %d tensors from %s into the local shards", count, self.plan.directory)


# ------------------------------------------------------------------------------------------- building
def _freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    from lightning_mm.core.patterns import PatternError, resolve_patterns

    try:
        paths = resolve_patterns(model, patterns, "freeze")
    except PatternError as err:
        raise TransformersModelConfigError(f"TransformersModel config {err}") from None
    frozen = {id(p) for path in paths for p in model.get_submodule(path).parameters()}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in frozen:
            if enclosing(name, paths) is None:
                log.warning("freeze: '%s' is frozen too, because it is tied to a frozen parameter", name)
            param.requires_grad_(False)
    return paths


def TransformersModel(config: Any) -> nn.Module:  # noqa: N802 - MindSpeed MM's name for this factory
    """Build the adapted Hugging Face model that ``config`` describes (see the module docstring for the keys).

    Returns an instance of the adapter class registered in :class:`~lightning_mm.modules.ModelHub`, or, for an
    architecture without one, of its Transformers class with the mixins added
    (:func:`~lightning_mm.hf.derived_adapters.derived_adapter`): a ``transformers.PreTrainedModel`` subclass with
    ``FSDP2Mixin`` and ``WeightInitMixin``, so module paths and state-dict keys are the Hugging Face ones.

    Every call of the returned model is checked before it computes
    (:func:`~lightning_mm.hf.batch_check.install_batch_check`: a forward pre-hook): a batch key its ``forward`` would
    swallow, images without as many placeholder tokens, Qwen-VL images without ``mm_token_type_ids`` or 3-D
    ``position_ids`` raise :class:`~lightning_mm.hf.batch_check.BatchCheckError`, whichever code calls the model
    (a seed ``forward_step``, an overridden one, a plain LightningModule, ``generate``). The first call of each kind
    is checked in full, later ones cost a set lookup.
    """
    from transformers import PreTrainedModel

    cfg = TransformersModelConfig.from_any(config)
    hf_config = build_hf_config(cfg)
    key, model_cls, source = resolve_model_class(cfg.model_id, hf_config)
    if not (isinstance(model_cls, type) and issubclass(model_cls, PreTrainedModel)):
        raise TransformersModelConfigError(
            f"ModelHub key '{key}' maps to {model_cls!r}, which is not a transformers.PreTrainedModel subclass"
        )
    missing_mixins = [m.__name__ for m in (FSDP2Mixin, WeightInitMixin) if not issubclass(model_cls, m)]
    if missing_mixins:
        raise TransformersModelConfigError(
            f"ModelHub key '{key}' maps to {model_cls.__name__}, which lacks {', '.join(missing_mixins)}; "
            f"declare it as `class {model_cls.__name__}(<HF model class>, FSDP2Mixin, WeightInitMixin)`"
        )
    if torch.empty(0).is_meta:
        raise TransformersModelConfigError(
            "TransformersModel cannot be built under torch.device('meta'): it would lose computed buffers such as "
            "rotary tables. Use MMFSDP2Strategy (parameters alone go to the meta device) or build it eagerly"
        )

    index = SafetensorsIndex.from_directory(cfg.init_from_hf_path) if cfg.init_from_hf_path else None
    if _meta_parameters_active():  # no parameter is allocated, whatever its size (plan, the strategy)
        model = build_on_meta(model_cls, hf_config)
        if index is not None:
            set_pending_pretrained(model, PendingPretrained(model, build_load_plan(model, index)))
    elif index is None:
        model = model_cls(hf_config)
    else:
        model = build_on_meta(model_cls, hf_config)
        load_into_meta_model(model, build_load_plan(model, index))
    frozen = _freeze(model, cfg.freeze) if cfg.freeze else []
    if cfg.lora is not None:
        from lightning_mm.hf.lora import apply_lora

        apply_lora(model, cfg.lora, frozen)
    install_packed_inputs(model)  # before the check, which then sees a packed row's per-sample positions
    install_batch_check(model)
    if cfg.enable_chunk_loss:  # after LoRA (the head may be adapted) and the batch check (it sees the labels)
        from lightning_mm.hf.chunk_loss import enable_chunk_loss

        enable_chunk_loss(model, cfg.chunk_loss_size)
    log.info(
        "TransformersModel: %s (%s)%s",
        model_cls.__name__,
        source,
        f" from {cfg.init_from_hf_path}" if cfg.init_from_hf_path else ", random init",
    )
    return model
