"""Reading a model-side config (``TransformersModel``'s, LoRA's) from the forms users and the CLI give it."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

__all__ = ["checked_fields"]


def checked_fields(config: Any, cls: type, what: str, error: type[Exception]) -> dict[str, Any]:
    """The keys of ``config`` (a mapping, or an object whose attributes are the keys: the seed's namespaces) for the
    dataclass ``cls``; a key ``cls`` does not have is ``error`` naming it, with the nearest valid key."""
    if isinstance(config, Mapping):
        data = dict(config)
    elif hasattr(config, "__dict__"):
        data = {k: v for k, v in vars(config).items() if not k.startswith("__")}
    else:
        raise error(f"{what} config must be a mapping or an object with attributes, got {type(config).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            suggestion = f"; did you mean `{hint[0]}`?" if hint else f"; valid keys: {', '.join(known)}"
            raise error(f"unknown {what} config key `{key}`{suggestion}")
    return data
