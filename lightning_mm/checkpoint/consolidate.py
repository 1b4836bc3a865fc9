"""Consolidating a checkpoint into one ``torch.save`` file, and the output rules every converter follows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from lightning_mm.checkpoint import atomic
from lightning_mm.checkpoint.checkpoint_errors import write_error
from lightning_mm.checkpoint.checkpoint_layout import EXTRA_KEY, SEP, fill_tensors
from lightning_mm.checkpoint.source import open_source
from lightning_mm.checkpoint.writer import write_file
from lightning_mm.errors import MissingFileError, OutputExistsError

__all__ = ["dcp_to_torch", "writing", "check_output"]


@contextlib.contextmanager
def writing(partial: Path, final: Path) -> Iterator[None]:
    """A failed write removes its partial output and says what failed (e.g. a full disk), naming the path."""
    try:
        yield
    except (Exception, CheckpointException) as error:
        with contextlib.suppress(OSError):
            atomic.remove(partial)
        raise write_error(error, final) from error


_OUTPUT_MARKERS = {"file": (), "hf": ("config.json",), "dcp": (".metadata",)}
"""What an existing output must be for ``force`` to replace it: a plain file (``torch.save`` output), or a directory
holding the marker file of a Hugging Face model (``config.json``) or of a DCP checkpoint (``.metadata``)."""


def check_output(dst: Path, force: bool = False, kind: str = "file") -> None:
    """A converter's output must not exist, unless ``force`` and it is an earlier output of the same ``kind``
    (:data:`_OUTPUT_MARKERS`): then it is replaced only once the new output is complete (``atomic.commit``)."""
    if dst.exists() or dst.is_symlink():
        if not force:
            raise OutputExistsError(f"output exists: {dst} (remove it, choose another path, or pass --force)")
        markers = _OUTPUT_MARKERS[kind]
        replaceable = (
            (dst.is_file() and not dst.is_symlink())
            if kind == "file"
            else (dst.is_dir() and not dst.is_symlink() and all((dst / m).is_file() for m in markers))
        )
        if not replaceable:
            what = "a file" if kind == "file" else f"a directory with {', '.join(markers)}"
            raise OutputExistsError(
                f"output exists: {dst}, and --force replaces only an earlier output ({what}); "
                "remove it or choose another path"
            )
    if not dst.parent.is_dir():
        raise MissingFileError(f"output directory does not exist: {dst.parent}")


def dcp_to_torch(src: str | Path, dst: str | Path, model_only: bool = False, force: bool = False) -> Path:
    """Consolidate any checkpoint this project writes into one ``torch.save`` file in Lightning's layout.

    The result has full tensors under ``state_dict`` and (unless ``model_only``) ``optimizer_states``, the rest of
    the checkpoint unchanged, and loads ``weights_only``; ``MMFSDP2Strategy`` resumes from it on any world size.
    Every file of a DCP source is checked against its manifest, whole-file hashes included, before any is read.
    ``force`` replaces an earlier output file (once the new one is complete).
    """
    dst = Path(dst)
    check_output(dst, force)
    source = open_source(src, full_check=True)
    meta = dict(source.meta)
    if model_only:
        meta.pop("optimizer_states", None)
    keys = [k for k in source.shapes if not model_only or k.startswith(f"state_dict{SEP}")]
    tensors = source.read_full(keys)
    full = fill_tensors(meta, lambda key: tensors[key])
    extra = dict(full.get(EXTRA_KEY) or {})
    extra["format"] = "torch"
    full[EXTRA_KEY] = extra
    partial = atomic.partial_path(dst)
    with writing(partial, dst):
        write_file(full, partial, with_manifest=True)
    atomic.commit(partial, dst)
    return dst
