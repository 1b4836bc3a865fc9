"""ModelHub: the registry that maps a model key to its adapted (FSDP2-ready) class, as in MindSpeed MM.

A key is a Hugging Face architecture name (``LlamaForCausalLM``), a ``model_type`` (``llama``) or any name of
your choosing (``internvl``). :meth:`ModelHub.resolve` looks a model up by an explicit ``model_id`` first, then
by the Hugging Face config's ``architectures[0]``, then by its ``model_type``; a miss is an error that lists what
is registered.

An adapter found by ``model_type`` applies only to the classes it was written for: when the config's
``architectures[0]`` names a class, it must be the Transformers class the adapter subclasses (or the adapter itself).
``LlamaForSequenceClassification`` with ``model_type: llama`` is not built as the causal-LM adapter registered for
``llama``; :func:`~lightning_mm.hf.derived_adapters.resolve_model_class` then builds the class
``architectures[0]`` names, or refuses a name that is no Transformers class.

Register an adapter with the decorator or by writing to the table directly, as MindSpeed MM does::

    @ModelHub.register("internvl_chat")
    class InternVLChatModelGeneration(InternVLForConditionalGeneration, FSDP2Mixin, WeightInitMixin): ...

    ModelHub.MODEL_MAPPINGS["internvl_chat"] = InternVLChatModelGeneration
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

from lightning_mm._utils.modules import transformers_class
from lightning_mm._utils.suggestions import nearest
from lightning_mm.errors import ConfigError, LightningMMError

__all__ = ["ModelHub", "ModelHubError"]


class ModelHubError(LightningMMError, KeyError):
    """A model key that no adapter is registered for, or a conflicting registration."""

    def __str__(self) -> str:  # KeyError would show the message with quotes around it
        return str(self.args[0]) if self.args else ""


class ModelHub:
    """The table of adapted model classes (``MODEL_MAPPINGS``) and the lookup rules over it."""

    MODEL_MAPPINGS: ClassVar[dict[str, type]] = {}
    _builtins_loaded: ClassVar[bool] = False

    @classmethod
    def _load_builtins(cls) -> None:
        """Register the built-in adapters on first lookup; entries the user made first are kept.

        Loading them lazily keeps ``import lightning_mm`` from importing Transformers' model code (which is slow,
        and on Ascend machines imports torch_npu).
        """
        if cls._builtins_loaded:
            return
        adapters = cls._builtin_adapters()
        cls._builtins_loaded = True
        user_entries = dict(cls.MODEL_MAPPINGS)
        cls.MODEL_MAPPINGS.clear()
        try:
            for adapter in adapters:
                cls.register(*cast(Any, adapter).hub_keys)(adapter)  # each adapter class declares hub_keys
        finally:
            cls.MODEL_MAPPINGS.update(user_entries)

    @classmethod
    def _builtin_adapters(cls) -> tuple[type, ...]:
        """The adapter classes this hub registers on first lookup (each names its keys in ``hub_keys``)."""
        from lightning_mm.hf.adapters import BUILTIN_ADAPTERS

        return tuple(BUILTIN_ADAPTERS)

    @classmethod
    def register(cls, *keys: str, override: bool = False) -> Callable[[type], type]:
        """Class decorator: register the class under every key in ``keys``.

        A key that is already taken by another class is an error unless ``override=True``.
        """
        if not keys or not all(isinstance(k, str) and k.strip() for k in keys):
            raise ConfigError(f"ModelHub.register needs one or more non-empty string keys, got {keys!r}")

        def decorate(model_cls: type) -> type:
            for key in keys:
                existing = cls.MODEL_MAPPINGS.get(key)
                if existing is not None and existing is not model_cls and not override:
                    raise ModelHubError(
                        f"ModelHub key '{key}' is already registered to {existing.__module__}.{existing.__qualname__}; "
                        "pass override=True to replace it"
                    )
                cls.MODEL_MAPPINGS[key] = model_cls
            return model_cls

        return decorate

    @classmethod
    def available(cls) -> list[str]:
        """The registered keys, sorted."""
        cls._load_builtins()
        return sorted(cls.MODEL_MAPPINGS)

    @classmethod
    def get(cls, key: str) -> type:
        """The class registered under ``key``; an unknown key is an error listing the registered ones."""
        cls._load_builtins()
        model_cls = cls.MODEL_MAPPINGS.get(key)
        if model_cls is None:
            raise ModelHubError(cls._unknown(f"model_id '{key}'", [key]))
        return model_cls

    @classmethod
    def resolve(cls, model_id: str | None = None, hf_config: Any = None) -> tuple[str, type]:
        """``(key, class)`` for an explicit ``model_id``, else ``architectures[0]``, else ``model_type``.

        ``hf_config`` is a Hugging Face config object or a dict with those keys.
        """
        cls._load_builtins()
        if model_id is not None:
            return model_id, cls.get(model_id)
        get = hf_config.get if isinstance(hf_config, dict) else (lambda k: getattr(hf_config, k, None))
        architectures = list(get("architectures") or []) if hf_config is not None else []
        model_type = get("model_type") if hf_config is not None else None
        tried = []
        if architectures:
            tried.append(architectures[0])
            if architectures[0] in cls.MODEL_MAPPINGS:
                return architectures[0], cls.MODEL_MAPPINGS[architectures[0]]
        if model_type:
            tried.append(model_type)
            if model_type in cls.MODEL_MAPPINGS:
                adapter = cls.MODEL_MAPPINGS[model_type]
                if not architectures or cls.serves(adapter, architectures[0]):
                    return model_type, adapter
                raise ModelHubError(cls._other_class(architectures[0], model_type, adapter))
        if not tried:
            raise ModelHubError(
                "cannot choose a model: give `model_id`, or a Hugging Face config with `architectures` or "
                f"`model_type`. Registered keys: {', '.join(cls.available()) or '(none)'}"
            )
        what = " or ".join(
            f"{label} '{value}'"
            for label, value in zip(["architectures[0]", "model_type"] if architectures else ["model_type"], tried)
        )
        raise ModelHubError(cls._unknown(what, tried))

    @staticmethod
    def serves(adapter: type, architecture: Any) -> bool:
        """Whether ``adapter`` builds the class ``architecture`` names: the adapter itself, or a Transformers class it
        derives from. An adapter over no Transformers class (a user's own model) serves any name."""
        models = [k for k in adapter.__mro__ if k.__module__.startswith("transformers.models.")]
        if not models:
            return True
        return architecture in {adapter.__name__, *(k.__name__ for k in models)}

    @classmethod
    def _other_class(cls, architecture: Any, model_type: str, adapter: type) -> str:
        base = transformers_class(adapter)
        built = f"{adapter.__name__}, a {base.__name__}" if base is not None else adapter.__name__
        return (
            f"architectures[0] '{architecture}' is not the class that the adapter registered for model_type "
            f"'{model_type}' builds ({built}). Give `model_id: {model_type}` to build that adapter anyway, or register "
            f"an adapter for '{architecture}'."
        )

    @classmethod
    def _unknown(cls, what: str, tried: list[str]) -> str:
        close = [m for t in tried for m in nearest(t, cls.available(), n=2)]
        hint = f" Did you mean {', '.join(repr(c) for c in dict.fromkeys(close))}?" if close else ""
        return (
            f"no model registered in ModelHub for {what}.{hint} Registered keys: "
            f"{', '.join(cls.available()) or '(none)'}. Register an adapter with @ModelHub.register(...)."
        )
