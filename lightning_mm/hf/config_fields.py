"""Reading a model-side config (``TransformersModel``'s, LoRA's) from the forms users and the CLI give it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_mm._utils.suggestions import find_unknown_key

__all__ = ["checked_fields"]


def checked_fields(config: Any, cls: type, what: str, error: type[Exception]) -> dict[str, Any]:
    """The keys of ``config`` (a mapping, or an object whose attributes are the keys: MindSpeed MM's namespaces) for the
    dataclass ``cls``; a key ``cls`` does not have is ``error`` naming it, with the nearest valid key."""
    if isinstance(config, Mapping):
        data = dict(config)
    elif hasattr(config, "__dict__"):
        data = {k: v for k, v in vars(config).items() if not k.startswith("__")}
    else:
        raise error(f"{what} config must be a mapping or an object with attributes, got {type(config).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = find_unknown_key(data, known)
    if unknown is not None:
        shown, hint = unknown
        raise error(f"unknown {what} config key `{shown}`{hint}")
    return data
