"""Reading checkpoints without executing pickled code.

Stock DCP reads its ``.metadata`` with ``pickle.load`` and non-tensor entries with ``torch.load(weights_only=False)``;
both could run arbitrary code from a crafted checkpoint. Here the metadata is read by an unpickler that only
rebuilds DCP's own metadata classes, the loader's non-tensor entries are read ``weights_only``, and the meta file
is checked at save time to be loadable ``weights_only`` (so a checkpoint never needs an unsafe load).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "UnsafeCheckpointError",
    "read_dcp_metadata",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "check_weights_only",
    "load_weights_only",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_METADATA: {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file references code that a safe load refuses to run."""


class _MetadataUnpickler(pickle.Unpickler):
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


def read_dcp_metadata(path: str | Path) -> Metadata:
    """Read ``<path>/.metadata`` of a DCP checkpoint with the restricted unpickler."""
    file = Path(path) / ".metadata"
    if not file.is_file():
        raise FileNotFoundError(f"not a complete DCP checkpoint (no .metadata): {path}")
    with file.open("rb") as stream:
        metadata = _MetadataUnpickler(stream, str(file)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{file}: expected DCP Metadata, found {type(metadata).__name__}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read with the restricted unpickler (tensors are read weights-only)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` for flat state dicts that reads any non-tensor entry ``weights_only``."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=allow_partial_load)

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
        raise TypeError(
            f"This checkpoint could not be loaded safely (weights_only): {found}. Store plain values "
            "(numbers, strings, lists, dicts, tensors) there"
        )


def load_weights_only(path: str | Path, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, with the file named in any error."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(f"{path}: not loadable weights_only: {error}") from error
