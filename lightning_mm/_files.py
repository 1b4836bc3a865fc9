"""File names that a file of a directory (a checkpoint's manifest, a safetensors index) may use for its siblings.

A leaf module: it imports nothing from ``lightning_mm``.
"""

from __future__ import annotations

import os

__all__ = ["is_plain_file_name"]


def is_plain_file_name(name: object) -> bool:
    """Whether ``name`` is a non-empty string naming a file directly in the directory it is read against.

    Absolute paths, separators (``/`` and ``\\``), ``.``, ``..`` and NUL characters are refused: they could lead
    outside the directory.
    """
    return (
        isinstance(name, str)
        and bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not os.path.isabs(name)
    )
