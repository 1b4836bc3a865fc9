"""The Transformers model class behind a model that may be adapted (``MMQwen2ForCausalLM``) or FSDP-wrapped.

A leaf module: it imports nothing from ``lightning_mm``, and not ``transformers`` either (a model can only be a
Transformers model once ``transformers`` is imported).
"""

from __future__ import annotations

import sys

__all__ = ["transformers_class"]


def transformers_class(cls: type) -> type | None:
    """The first class in ``cls``'s MRO that is a ``PreTrainedModel`` defined in ``transformers.models``, or ``None``.

    Adapters and FSDP's wrapper classes derive from it; a model with remote code (module ``transformers_modules.*``)
    or a plain ``nn.Module`` has none: the generic bases (``PreTrainedModel``, ``GenerationMixin``) do not count.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    base = transformers.PreTrainedModel
    for klass in cls.__mro__:
        if klass.__module__.startswith("transformers.models.") and issubclass(klass, base):
            return klass
    return None
