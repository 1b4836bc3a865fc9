"""FSDP2-ready classes for Transformers architectures that have no adapter in :class:`~lightning_mm.modules.ModelHub`.

:func:`derived_adapter` turns any ``transformers.PreTrainedModel`` class into ``MM<Class>(<Class>, FSDP2Mixin,
WeightInitMixin)``, the recipe of the built-in adapters, whose default plan is derived from the model's metadata
(:func:`lightning_mm.hf.default_plans.derive_fsdp2_plan`). :func:`resolve_model_class` is how
:func:`~lightning_mm.modules.TransformersModel` picks a class: a registered adapter first (registration stays the
way to give a custom class or plan), else the Transformers class the config names (``architectures[0]``, or
``model_id`` when it is a Transformers class name, or, for a config without ``architectures``, the class
Transformers' auto mappings give for its ``model_type``). An adapter registered for the ``model_type`` serves only
the classes it was written for (:meth:`ModelHub.serves`): another Transformers class named by ``architectures[0]``
is built as that class, and a name that is no Transformers class is an error naming ``architectures[0]``. Only
classes of the ``transformers`` package itself are used: nothing else is imported.

A derived class lives in this module under its name (``lightning_mm.hf.derived_adapters.MMGemma3ForConditional
Generation``), so that pickling by reference works in any process.
"""

from __future__ import annotations

from typing import Any

from lightning_mm.errors import InputTypeError
from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin
from lightning_mm.hf.model_hub import ModelHub, ModelHubError

__all__ = ["derived_adapter", "transformers_architecture", "resolve_model_class", "is_derived", "DERIVED"]

DERIVED = "derived from the model's Transformers metadata (no ModelHub adapter registered)"
"""The source :func:`resolve_model_class` names for a derived class."""

_CACHE: dict[type, type] = {}


def transformers_architecture(name: Any) -> type | None:
    """The ``transformers`` model class called ``name`` (``Gemma3ForConditionalGeneration``), or ``None``."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        return None
    import transformers

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


def derived_adapter(base: type) -> type:
    """``MM<Base>(base, FSDP2Mixin, WeightInitMixin)``, made once per class."""
    from transformers import PreTrainedModel

    if not (isinstance(base, type) and issubclass(base, PreTrainedModel)):
        raise InputTypeError(f"derived_adapter needs a transformers.PreTrainedModel subclass, got {base!r}")
    if issubclass(base, FSDP2Mixin) and issubclass(base, WeightInitMixin):
        return base
    cls = _CACHE.get(base)
    if cls is None:
        name = f"MM{base.__name__}"
        cls = type(
            name,
            (base, FSDP2Mixin, WeightInitMixin),
            {
                "__module__": __name__,
                "__qualname__": name,
                "hub_keys": (base.__name__,),
                "__doc__": (
                    f"``transformers.{base.__name__}``, FSDP2-ready; its default plan is derived from its metadata."
                ),
            },
        )
        _CACHE[base] = cls
        globals()[name] = cls
    return cls


def is_derived(cls: type) -> bool:
    """Whether ``cls`` was made by :func:`derived_adapter`."""
    return cls in _CACHE.values()


def __getattr__(name: str) -> type:  # unpickling in a fresh process: make the class on demand
    base = transformers_architecture(name[2:]) if name.startswith("MM") else None
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return derived_adapter(base)


def _auto_class(model_type: Any) -> type | None:
    """The class Transformers' auto mappings give for ``model_type`` (image-text-to-text first, then causal LM)."""
    if not isinstance(model_type, str):
        return None
    from transformers.models.auto import modeling_auto

    for mapping in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):
        found = transformers_architecture(getattr(modeling_auto, mapping, {}).get(model_type))
        if found is not None:
            return found
    return None


def resolve_model_class(model_id: str | None = None, hf_config: Any = None) -> tuple[str, type, str]:
    """``(key, class, source)``: the ModelHub adapter for ``model_id`` / the config, else a derived class.

    ``source`` says where the class and its default plan come from (``"ModelHub adapter 'qwen3'"`` or
    :data:`DERIVED`). A model neither names is the ModelHub error, with what to set.
    """
    try:
        key, cls = ModelHub.resolve(model_id, hf_config)
        return key, cls, f"ModelHub adapter '{key}' ({cls.__name__})"
    except ModelHubError as err:
        get = hf_config.get if isinstance(hf_config, dict) else (lambda k: getattr(hf_config, k, None))
        if model_id is not None:
            names = [model_id]
        else:
            names = list(get("architectures") or [])[:1] if hf_config is not None else []
        for name in names:
            base = transformers_architecture(name)
            if base is not None:
                return name, derived_adapter(base), DERIVED
        if model_id is None and hf_config is not None and not names:  # a named class is never replaced by another
            base = _auto_class(get("model_type"))
            if base is not None:
                return base.__name__, derived_adapter(base), DERIVED
        raise ModelHubError(
            f"{err} Or name a Transformers model class (`architectures` in the config, or `model_id`): its plan is "
            "then derived from the model's metadata"
        ) from None
