"""Reading a checkpoint (:class:`CheckpointSource`): opening a ``torch_dcp`` directory or a ``torch`` file safely,
every byte checked against its manifest first (:func:`open_source`), the ranks of a distributed load sharing the
hashing and agreeing on the outcome (:func:`open_agreed`), and reading its tensors into a model's or an optimiser's
(sharded) ones."""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_mm._utils.distributed import rank_zero_warn
from lightning_mm.checkpoint import digest, formats, hf_weights, manifest, zip_manifest
from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError, CheckpointNotFoundError
from lightning_mm.checkpoint.checkpoint_layout import EXTRA_KEY, META_FILE, model_key, split_tensors
from lightning_mm.checkpoint.rank_agreement import is_distributed
from lightning_mm.checkpoint.safe import SafeFileSystemReader, SafeLoadPlanner, load_weights_only, read_dcp_metadata

__all__ = ["CheckpointSource", "open_source", "open_agreed", "open_directory", "open_file", "single_process_quiet"]


@dataclass
class CheckpointSource:
    """A checkpoint on disk: its meta tree and the shapes of its stored tensors, and a way to read them."""

    path: Path | str
    """The local directory or file, or the URL of a remote checkpoint (:mod:`.remote`)."""
    meta: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    is_dcp: bool
    _tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    reader: Callable[[], Any] | None = field(default=None, repr=False)
    """Makes the DCP storage reader of a checkpoint that is not a local directory (:mod:`.remote`)."""
    hf_names: dict[str, str] | None = field(default=None, repr=False)
    """The model tensors are Hugging Face safetensors: each stored key's name there (:mod:`.hf_weights`)."""

    def _storage_reader(self) -> Any:
        return self.reader() if self.reader is not None else SafeFileSystemReader(self.path)

    @property
    def extra(self) -> dict[str, Any]:
        return self.meta.get(EXTRA_KEY) or {}

    def read_into(self, destinations: Mapping[str, torch.Tensor]) -> None:
        """Fill each destination tensor (a DTensor receives its own shard) from the stored key of the same name."""
        if not destinations:
            return
        if self.hf_names is not None:
            hf_weights.read_into(self.path, destinations, self.hf_names, is_distributed())
            return
        if self.is_dcp:
            with single_process_quiet():
                dcp.load(
                    dict(destinations),
                    storage_reader=self._storage_reader(),
                    planner=SafeLoadPlanner(),
                    no_dist=not is_distributed(),
                )
            return
        assert self._tensors is not None
        for key, dest in destinations.items():
            _copy_full_into(self._tensors[key], dest)

    def read_full(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """Full CPU tensors for ``keys`` (a single process may call this)."""
        if not self.is_dcp:
            assert self._tensors is not None
            return {k: self._tensors[k] for k in keys}
        out = {k: torch.empty(self.shapes[k], dtype=self.dtypes[k]) for k in keys}
        if out and self.hf_names is not None:
            hf_weights.read_into(self.path, out, self.hf_names, distributed=False)
        elif out:
            with single_process_quiet():
                dcp.load(out, storage_reader=self._storage_reader(), planner=SafeLoadPlanner(), no_dist=True)
        return out


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _copy_full_into(full: torch.Tensor, dest: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(dest, DTensor):
            shard = distribute_tensor(full.to(dest.dtype), dest.device_mesh, dest.placements, src_data_rank=None)
            dest.to_local().copy_(shard.to_local())
        else:
            dest.copy_(full)


def open_source(path: str | Path, full_check: bool = False, share: tuple[int, int] | None = None) -> CheckpointSource:
    """Open a checkpoint written by this project (a DCP directory or a consolidated file), safely.

    The format is the first registered one that recognises ``path`` (:func:`.formats.recognise`), which reads it.
    Every byte is checked against the checkpoint's manifest first (:func:`.manifest.verify`,
    :func:`.zip_manifest.verify`); ``full_check`` also checks the SHA-256 of a version 1 manifest (otherwise checked
    by sample only). ``share=(rank, world_size)``: this rank hashes only its share of the files (or records), the
    others the rest; the caller must then agree with them on the outcome (:func:`open_agreed` does). (A checkpoint
    at a URL is opened by :func:`.remote.open_source`.)
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint not found: {path}")
    fmt = formats.recognise(path)
    if fmt is None:
        raise CheckpointNotFoundError(f"{path} is not a checkpoint (neither a file nor a directory)")
    return fmt.read(path, full_check, share)


def open_directory(path: Path, full_check: bool = False, share: tuple[int, int] | None = None) -> CheckpointSource:
    """:func:`open_source` of a ``torch_dcp`` directory (also one holding Hugging Face weights)."""
    if not (path / META_FILE).is_file() or not (path / ".metadata").is_file():
        raise CheckpointNotFoundError(
            f"{path} is not a complete torch_dcp checkpoint (it needs both .metadata and {META_FILE})"
        )
    hashed = None
    if share is not None:
        found = manifest.read_manifest(path)
        sizes = {name: entry["size"] for name, entry in (found or {}).get("files", {}).items()}
        hashed = digest.assign(sizes, *share, prefer=manifest.shard_rank)
    listed = manifest.verify(path, full=full_check, hashed=hashed)
    metadata = read_dcp_metadata(path)
    meta = load_weights_only(manifest.inside(path, path / META_FILE))
    _check_listed(path, listed, metadata, meta, full_check)
    shapes, dtypes = {}, {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            shapes[key], dtypes[key] = tuple(item.size), item.properties.dtype
    record = (meta.get(EXTRA_KEY) or {}).get(hf_weights.RECORD_KEY) if isinstance(meta, dict) else None
    if record is not None and not any(k.startswith(model_key("")) for k in shapes):  # checkpoint_format="hf"
        hf_shapes, hf_dtypes, names = hf_weights.weights_view(path, record, (listed or {}).get("files"))
        return CheckpointSource(
            path, meta, {**shapes, **hf_shapes}, {**dtypes, **hf_dtypes}, is_dcp=True, hf_names=names
        )
    return CheckpointSource(path, meta, shapes, dtypes, is_dcp=True)


def open_file(path: Path, share: tuple[int, int] | None = None) -> CheckpointSource:
    """:func:`open_source` of a ``torch`` file."""
    zip_manifest.verify(path, digest.assign(zip_manifest.sizes(path), *share) if share is not None else None)
    full = load_weights_only(path, mmap=True)
    if not isinstance(full, dict):
        raise CheckpointIntegrityError(f"{path}: not a Lightning checkpoint (a {type(full).__name__}, not a dict)")
    meta, tensors = split_tensors(full)
    return CheckpointSource(
        path,
        meta,
        {k: tuple(v.shape) for k, v in tensors.items()},
        {k: v.dtype for k, v in tensors.items()},
        is_dcp=False,
        _tensors=tensors,
    )


def open_agreed(path: Path | str, rank: int, world_size: int) -> CheckpointSource:
    """:func:`open_source` on every rank of a load, each hashing its share of the files: when any rank finds a
    fault, every rank raises it (the first failing rank's error), so that none goes on into a collective alone."""
    error: BaseException | None = None
    source = None
    try:
        source = open_source(path, share=(rank, world_size) if is_distributed() else None)
    except Exception as err:  # every failure is shared, whatever it is
        error = err
    if not is_distributed():
        if error is not None:
            raise error
        assert source is not None
        return source
    try:
        shared = pickle.loads(pickle.dumps(error))
    except Exception:
        shared = CheckpointIntegrityError(str(error))
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, shared)
    if error is not None:
        raise error
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    assert source is not None
    return source


def _check_listed(
    path: Path, listed: dict[str, Any] | None, metadata: Any, meta: Any, full_check: bool = False
) -> None:
    """Every file the DCP metadata reads is in the manifest; a checkpoint without one warns, unless it was written
    with one (then its manifest was removed); so does one whose manifest is checked by sample only."""
    extra = (meta.get(EXTRA_KEY) or {}) if isinstance(meta, dict) else {}
    if listed is None:
        if extra.get("manifest"):
            raise CheckpointIntegrityError(
                f"{path / manifest.MANIFEST_FILE}: missing; this checkpoint was written "
                "with a manifest, so its files cannot be trusted without it"
            )
        rank_zero_warn(
            f"{path} has no {manifest.MANIFEST_FILE} (written by an older lightning-mm): its files are "
            "not checked against one another"
        )
        return
    if manifest.sampled_only(listed) and not full_check:
        rank_zero_warn(
            f"{path}: its {manifest.MANIFEST_FILE} is of an older lightning-mm (version 1), which "
            "recorded sampled fingerprints for loads: its files are checked by sample only (256 KiB of "
            "each; `lightning-mm convert dcp-to-torch` checks their SHA-256). Save it again to have "
            "every byte checked on load"
        )
    for name in (".metadata", META_FILE, *(i.relative_path for i in (metadata.storage_data or {}).values())):
        if name not in listed["files"]:
            raise CheckpointIntegrityError(f"{path / name}: not listed in the checkpoint's {manifest.MANIFEST_FILE}")
