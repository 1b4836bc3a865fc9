"""DiffusersHub: ModelHub's registry and lookup rules for diffusers models, keyed by their class names.

A diffusers ``config.json`` names its class in ``_class_name`` (``WanTransformer3DModel``); :meth:`DiffusersHub.resolve`
looks a model up by an explicit ``model_id`` first, then by that name. The built-in adapters
(:mod:`lightning_mm.diffusers.adapters` and :mod:`lightning_mm.diffusers.hunyuan15_adapter`, which import ``diffusers``)
are registered on the first lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from lightning_mm.errors import DependencyError
from lightning_mm.hf.model_hub import ModelHub, ModelHubError

__all__ = ["DiffusersHub", "ModelHubError", "diffusers_installed"]


def diffusers_installed() -> None:
    """Import ``diffusers`` or fail with the extra to install."""
    try:
        import diffusers  # noqa: F401
    except ImportError as err:
        raise DependencyError(
            f"diffusers models need the `diffusers` package ({err}); install it with "
            "`pip install 'lightning-mm[diffusers]'`"
        ) from None


class DiffusersHub(ModelHub):
    """The table of adapted diffusers model classes; keys are diffusers class names (``_class_name``)."""

    MODEL_MAPPINGS: ClassVar[dict[str, type]] = {}
    _builtins_loaded: ClassVar[bool] = False

    @classmethod
    def _builtin_adapters(cls) -> tuple[type, ...]:
        diffusers_installed()
        from lightning_mm.diffusers.adapters import BUILTIN_ADAPTERS
        from lightning_mm.diffusers.hunyuan15_adapter import HUNYUAN15_ADAPTERS

        return (*BUILTIN_ADAPTERS, *HUNYUAN15_ADAPTERS)

    @classmethod
    def resolve_diffusers(cls, model_id: str | None, config: Mapping[str, Any]) -> tuple[str, type]:
        """``(key, class)`` for ``model_id``, else for the diffusers config's ``_class_name``."""
        if model_id is None and not config.get("_class_name"):
            cls._load_builtins()
            raise ModelHubError(
                "cannot choose a diffusers model: give `model_id`, or a diffusers config.json with `_class_name`. "
                f"Registered keys: {', '.join(cls.available())}"
            )
        return cls.resolve(model_id, {"architectures": [config["_class_name"]]} if model_id is None else None)
