"""File names that a file of a directory (a checkpoint's manifest, a safetensors index) may use for its siblings, and
the one rule for the files of a Hugging Face model directory that are symbolic links.

A leaf module: it imports nothing from ``lightning_mm``.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_mm.errors import ConfigError

__all__ = ["is_plain_file_name", "link_root", "model_file"]


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


def link_root(directory: Path) -> Path:
    """The folder that the files of a Hugging Face model ``directory`` may be symbolic links into.

    A hub-cache snapshot (``<cache>/models--org--name/snapshots/<revision>/``, as ``huggingface_hub`` downloads it)
    keeps its files as links to ``../../blobs/<hash>``: its root, and that of any folder in it (a diffusers
    pipeline's ``transformer/``), is the repository's cache folder ``models--org--name``. Any other directory is its
    own root. The directory is taken with links resolved.
    """
    real = directory.resolve()
    for revision in (real, *real.parents):
        snapshots = revision.parent
        repo = snapshots.parent
        if snapshots.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
            return repo
    return real


def model_file(directory: Path, name: str, error: type[Exception] = ConfigError) -> Path:
    """``directory / name``, a regular file of a Hugging Face model directory, or ``error`` naming it.

    The same rule for every reader (``TransformersModel``'s ``init_from_hf_path``, ``convert hf-to-dcp``): the name
    is a plain file name, and the file is a regular file or a symbolic link (a chain of them) to a regular file
    inside :func:`link_root`; a link leaving that root is refused.
    """
    path = directory / name
    if not is_plain_file_name(name):
        raise error(f"{path}: not a file name of the directory {directory}")
    if not path.is_symlink():
        if not path.exists():
            raise error(f"{path}: missing")
        if not path.is_file():
            raise error(f"{path}: not a regular file")
        return path
    root = link_root(directory)
    target = path.resolve()
    if not target.is_relative_to(root):
        raise error(
            f"{path}: a symbolic link to {target}, outside {root}; the files of a model directory are regular "
            "files, or links inside the directory (or inside its Hugging Face cache folder, for a hub snapshot)"
        )
    if not target.is_file():
        raise error(f"{path}: a symbolic link to {target}, which is not a regular file")
    return path
