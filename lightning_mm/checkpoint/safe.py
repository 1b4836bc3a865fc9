"""Reading checkpoints without executing pickled code.

Stock DCP reads its ``.metadata`` with ``pickle.load`` and non-tensor entries with ``torch.load(weights_only=False)``;
both could run arbitrary code from a crafted checkpoint. Here the metadata is read by an unpickler that only
rebuilds DCP's own metadata classes, the loader's non-tensor entries are read ``weights_only``, and the meta file
is checked at save time to be loadable ``weights_only`` (so a checkpoint never needs an unsafe load).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from lightning_mm.checkpoint.checkpoint_errors import CheckpointError, CheckpointIntegrityError, CheckpointNotFoundError
from lightning_mm.checkpoint.manifest import check_name, inside
from lightning_mm.errors import InputTypeError

__all__ = [
    "UnsafeCheckpointError",
    "read_dcp_metadata",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "check_weights_only",
    "load_weights_only",
    "MetadataUnpickler",
    "unpickler_reason",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_METADATA: {
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file references code that a safe load refuses to run."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler for DCP's ``.metadata`` file that builds only DCP's own metadata classes and torch dtypes; any
    other reference raises :class:`UnsafeCheckpointError` naming ``source``."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source}: refusing to load {module}.{name}; a DCP metadata file holds only DCP's own classes"
        )


def read_dcp_metadata(path: str | os.PathLike[str]) -> Metadata:
    """Read ``<path>/.metadata`` of a DCP checkpoint with the restricted unpickler, and check what it refers to.

    Every shard file it names must be a regular file inside the checkpoint directory (no absolute path, ``..`` or
    symbolic link), holding every byte range read from it.
    """
    directory = Path(path)
    file = directory / ".metadata"
    if not file.is_file():
        raise CheckpointNotFoundError(f"not a complete DCP checkpoint (no .metadata): {path}")
    inside(directory, file)
    try:
        with file.open("rb") as stream:
            metadata = MetadataUnpickler(stream, str(file)).load()
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as error:
        if isinstance(error, UnsafeCheckpointError):
            raise
        raise CheckpointIntegrityError(f"{file}: truncated or corrupted ({type(error).__name__}: {error})") from error
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{file}: expected DCP Metadata, found {type(metadata).__name__}")
    _check_storage(directory, metadata)
    return metadata


def _check_storage(directory: Path, metadata: Metadata) -> None:
    """Every byte range of ``metadata`` lies in a regular file inside ``directory``."""
    sizes: dict[str, int] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name not in sizes:
            file = check_name(directory, name, ".metadata")  # refuses anything but a plain file name
            name = file.name
            sizes[name] = inside(directory, file).stat().st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise CheckpointIntegrityError(f"{directory / '.metadata'}: invalid byte range for {index.fqn}")
        if offset + length > sizes[name]:
            raise CheckpointIntegrityError(
                f"{directory / name}: truncated ({sizes[name]} bytes; {index.fqn} is stored up to byte "
                f"{offset + length})"
            )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read with the restricted unpickler (tensors are read weights-only)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` for flat state dicts that reads any non-tensor entry ``weights_only``."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=allow_partial_load)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _find_unsafe(tree: Any, path: str) -> str | None:
    """The first entry of ``tree`` that a weights-only load refuses (``path: type``), or None."""
    try:
        buffer = io.BytesIO()
        torch.save(tree, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
        return None
    except Exception as error:  # any refusal is what we look for
        if isinstance(tree, Mapping):
            for key, value in tree.items():
                found = _find_unsafe(value, f"{path}.{key}" if path else str(key))
                if found:
                    return found
        elif isinstance(tree, (list, tuple)):
            for i, value in enumerate(tree):
                found = _find_unsafe(value, f"{path}[{i}]")
                if found:
                    return found
        return f"{path or '<root>'} ({type(tree).__module__}.{type(tree).__qualname__}: {error})"


def check_weights_only(meta: Mapping[str, Any]) -> None:
    """Raise before anything is written if ``meta`` could not be loaded back ``weights_only``.

    The usual culprits are hyper-parameters holding arbitrary objects (save plain values instead, e.g. with
    ``save_hyperparameters(ignore=[...])``) or custom objects returned by a callback's ``state_dict``.
    """
    found = _find_unsafe(dict(meta), "")
    if found:
        raise InputTypeError(
            f"This checkpoint could not be loaded safely (weights_only): {found}. Store plain values "
            "(numbers, strings, lists, dicts, tensors) there"
        )


def unpickler_reason(error: BaseException) -> str:
    """The reason torch's weights-only unpickler gives, without its advice to load unsafely."""
    paragraphs = [p.strip().removeprefix("WeightsUnpickler error:").strip() for p in str(error).split("\n\n")]
    kept = [
        p
        for p in paragraphs
        if p and not any(word in p for word in ("weights_only", "Weights only", "documentation", "trusted source"))
    ]
    return " ".join(kept).replace("\n", " ") or type(error).__name__


def load_weights_only(path: str | Path, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU; any failure names the file, and says what failed.

    A file referencing code is an :class:`UnsafeCheckpointError`; a truncated or corrupted one a
    :class:`~.errors.CheckpointIntegrityError` (never a bare ``EOFError``, and never advice to load it unsafely).
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointIntegrityError(f"{path}: a directory, not a checkpoint file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as error:
        reason = unpickler_reason(error)
        if any(word in reason.lower() for word in ("global", "unsupported class", "blocked")):
            raise UnsafeCheckpointError(
                f"{path}: not loadable weights_only, it references code ({reason}); a checkpoint holds plain data"
            ) from None
        raise CheckpointIntegrityError(f"{path}: corrupted ({reason})") from None
    except (EOFError, RuntimeError, ValueError, KeyError, IndexError, TypeError) as error:
        text = str(error).strip()
        reason = text.splitlines()[0].split(". ")[0] if text else type(error).__name__
        state = "truncated" if isinstance(error, EOFError) or "central directory" in reason else "corrupted"
        raise CheckpointIntegrityError(f"{path}: {state}, not a readable torch file ({reason})") from None
