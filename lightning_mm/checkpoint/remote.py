"""``torch_dcp`` checkpoints at fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...), for stores without rename.

Every rank writes its shards with DCP's fsspec storage under a hidden *staging* prefix next to the checkpoint,
``<parent>/.<name>.partial-<token>/`` (the token names the writing process, as locally: :mod:`.atomic`); rank 0
adds ``meta.pt``. The commit copies the staged objects to ``<parent>/<name>/`` (a server-side copy on S3) and
writes ``manifest.json`` last: a checkpoint is complete exactly when its manifest is there, and a prefix without
one is never loaded (a clear error names it). Replacing a checkpoint (``last.ckpt``) deletes the old one's
manifest first, then its objects; removing one does the same. A save first deletes the staging and removal
prefixes of its directory whose writer is this process or provably gone (:func:`.atomic.is_abandoned`): an
interrupted save leaves nothing that a later save does not clean up.

The manifest is a local one's (:mod:`.manifest`, version 2): each object's size and XXH3-128 digest
(:mod:`.digest`), bounded and parsed as locally (:func:`.manifest.parse`: one above :data:`.manifest.MAX_BYTES` is
refused from its listed size, before it is read). A load checks that every listed object is there and of its size
(stopping at the first that is not), then the digest of each (every byte, read once more for it: the price of a
remote check; stopping at the first mismatch), and that no ``.distcp`` object is there that the manifest does not
list. Checkpoints written at URLs by earlier lightning-mm versions carry a version 1 manifest (a SHA-256 over the
SHA-256 of 16 MiB chunks, and a sample fingerprint): their SHA-256 is checked, or with ``full_check=False`` the
sample of the objects other than ``.metadata`` and ``meta.pt``.

``storage_options`` (credentials, endpoint) go to fsspec only: they are never logged, never put in an error
message and never written into the checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import pickle
import posixpath
import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_mm._compat import fsspec_storage
from lightning_mm._utils.model_files import is_plain_file_name
from lightning_mm.checkpoint import atomic, digest, formats
from lightning_mm.checkpoint import manifest as manifests
from lightning_mm.checkpoint.checkpoint_errors import (
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    write_error,
)
from lightning_mm.checkpoint.checkpoint_layout import EXTRA_KEY, META_FILE, pop_loader_states, split_tensors
from lightning_mm.checkpoint.dcp_writers import NoEmptyFiles
from lightning_mm.checkpoint.manifest import MANIFEST_FILE
from lightning_mm.checkpoint.rank_agreement import (
    broadcast_from_rank_zero,
    gather_to_rank_zero,
    is_distributed,
    raise_on_every_rank,
)
from lightning_mm.checkpoint.safe import (
    MetadataUnpickler,
    UnsafeCheckpointError,
    check_weights_only,
    unpickler_reason,
)
from lightning_mm.checkpoint.source import CheckpointSource, single_process_quiet
from lightning_mm.checkpoint.state import copy_loops
from lightning_mm.errors import InputTypeError, OutputExistsError

__all__ = ["is_url", "RemoteStore", "save", "open_source", "remove", "download", "upload"]

_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]*)://")
_LOCAL = ("file", "local")
_CHUNK = 16 << 20
_BLOCKS, _BLOCK_SIZE = 4, 64 * 1024
_DCP_SUFFIX = ".distcp"


def is_url(path: Any) -> bool:
    """A string naming a non-local fsspec URL (``s3://bucket/run``, ``memory://x``); ``file://`` and paths are local."""
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and match["protocol"].lower() not in _LOCAL


class RemoteStore:
    """The fsspec file system of one checkpoint URL and where the checkpoint lies in it."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        from fsspec.core import url_to_fs

        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise InputTypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self.url = url.rstrip("/")
        self.protocol = _URL.match(self.url)["protocol"]  # type: ignore[index]
        self.options = dict(storage_options or {})
        self.fs, root = url_to_fs(self.url, **self.options)
        self.fs.invalidate_cache()  # other processes (ranks, runs) write here: no listing is reused
        self.root = root.rstrip("/")
        self.parent, self.name = posixpath.split(self.root)

    def url_of(self, path: str) -> str:
        """The URL of a path of this file system (for messages and DCP)."""
        return f"{self.protocol}://{path.lstrip('/') if self.protocol != 'memory' else path}"

    # ------------------------------------------------------------------------------------------ writing
    def staging(self) -> str:
        """A new staging prefix of this checkpoint, named after this process (:func:`.atomic.partial_path`)."""
        return str(atomic.partial_path(PurePosixPath(self.root)))

    def remove_abandoned(self) -> None:
        """Delete the staging and removal prefixes of this directory whose writer is this process or is gone."""
        for entry in self.children(self.parent):
            if atomic.is_abandoned(posixpath.basename(entry)):
                self.delete(entry)

    def commit(self, staging: str, names: list[str], manifest: bytes) -> None:
        """Copy the staged objects to the checkpoint's prefix, the manifest last; then drop the staging prefix."""
        if self.fs.exists(self.root):
            self.delete(self.root)  # its manifest first: from then on it is not a complete checkpoint
        for name in names:
            self.fs.copy(f"{staging}/{name}", f"{self.root}/{name}")
        self.fs.pipe_file(f"{self.root}/{MANIFEST_FILE}", manifest)
        self.delete(staging)

    def delete(self, prefix: str) -> None:
        """Delete the objects under ``prefix``, its manifest first (a half-deleted checkpoint is never complete)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{prefix}/{MANIFEST_FILE}")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(prefix, recursive=True)
        self.fs.invalidate_cache(self.parent)

    def children(self, prefix: str) -> list[str]:
        """The entries directly under ``prefix`` (none if it does not exist), listed afresh."""
        try:
            return [p.rstrip("/") for p in self.fs.ls(prefix, detail=False, refresh=True)]
        except FileNotFoundError:
            return []
        except TypeError:  # a file system whose ls has no refresh
            return [p.rstrip("/") for p in self.fs.ls(prefix, detail=False)]

    # ------------------------------------------------------------------------------------------ hashing
    def entry(self, path: str) -> dict[str, Any]:
        """Size and digest of one object (a version 2 entry of :mod:`.manifest`)."""
        stream = digest.StreamDigest()
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                stream.update(chunk)
        return {"size": stream.length, digest.FIELD: stream.hexdigest()}

    def sha256(self, path: str) -> str:
        """The SHA-256 over the SHA-256 of each 16 MiB chunk of one object (what version 1 manifests record)."""
        digests = []
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digests.append(hashlib.sha256(chunk).digest())
        return _whole(int(self.fs.info(path)["size"]), digests)

    def sample(self, path: str, size: int) -> str:
        digest = hashlib.sha256(size.to_bytes(8, "little"))
        whole = size <= _BLOCKS * _BLOCK_SIZE
        with self.fs.open(path, "rb") as f:
            for offset in _sample_offsets(size):
                f.seek(offset)
                digest.update(f.read(size if whole else _BLOCK_SIZE))
        return digest.hexdigest()


def _whole(size: int, digests: list[bytes]) -> str:
    return hashlib.sha256(size.to_bytes(8, "little") + b"".join(digests)).hexdigest()


def _hash_bytes(data: bytes) -> str:
    return _whole(len(data), [hashlib.sha256(data[i : i + _CHUNK]).digest() for i in range(0, len(data), _CHUNK)])


def _sample_offsets(size: int) -> list[int]:
    if size <= _BLOCKS * _BLOCK_SIZE:
        return [0]
    last = size - _BLOCK_SIZE
    return [last * k // (_BLOCKS - 1) for k in range(_BLOCKS)]


def _manifest_bytes(files: Mapping[str, dict[str, Any]]) -> bytes:
    return json.dumps(manifests.manifest_body(files), indent=1).encode()


# -------------------------------------------------------------------------------------------- saving
def _writer(url: str, options: Mapping[str, Any]) -> Any:
    """DCP's FsspecWriter that notes the files this rank wrote."""
    fsspec_writer, _ = fsspec_storage()

    class Writer(NoEmptyFiles, fsspec_writer):  # type: ignore[misc, valid-type]
        written: set[str] = set()

        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            future.wait()
            self.written = {r.storage_data.relative_path for r in future.value()}
            return future

    # Object stores commit each object when it is closed: no fsync (torch would call os.sync() instead).
    return Writer(url, sync_files=False, **options)


def save(
    checkpoint: dict[str, Any],
    url: str,
    fmt: str,
    extra: dict[str, Any],
    rng: dict[str, Any] | None,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Write a ``torch_dcp`` checkpoint to ``url`` (see the module docstring); every rank calls this, as
    :func:`.writer.save`."""
    formats.checkpoint_format(fmt).refuse_url(url)  # the formats written at URLs are torch_dcp directories
    store = RemoteStore(url, storage_options)
    checkpoint = copy_loops(checkpoint)
    ranks = gather_to_rank_zero({"rng": rng, "combined_loader": pop_loader_states(checkpoint)})
    rank0 = ranks is not None
    meta, tensors = split_tensors(checkpoint)
    meta[EXTRA_KEY] = {**extra, "format": fmt, "ranks": ranks, "manifest": MANIFEST_FILE}
    error = None
    if rank0:
        try:
            check_weights_only(meta)
        except TypeError as err:
            error = str(err)
    raise_on_every_rank(error)
    staging = None
    if rank0:
        store.remove_abandoned()
        staging = store.staging()
    staging = broadcast_from_rank_zero(staging)
    failure, original, entries = None, None, {}
    try:
        writer = _writer(store.url_of(staging), store.options)
        with single_process_quiet():
            dcp.save(
                tensors,
                storage_writer=writer,
                planner=DefaultSavePlanner(flatten_state_dict=False),
                no_dist=not is_distributed(),
            )
        entries = {name: store.entry(f"{staging}/{name}") for name in sorted(writer.written)}
    except Exception as err:
        failure, original = _failure(err, url), err
    results = gather_to_rank_zero((failure, entries))
    if rank0:
        assert results is not None  # rank 0 holds every rank's result
        failure = next((f for f, _ in results if f is not None), None)
        if failure is None:
            try:
                buffer = io.BytesIO()
                torch.save(meta, buffer)
                store.fs.pipe_file(f"{staging}/{META_FILE}", buffer.getvalue())
                files: dict[str, dict[str, Any]] = {}
                for _, part in results:
                    files.update(part)
                for name in (".metadata", META_FILE):
                    files[name] = store.entry(f"{staging}/{name}")
                store.commit(staging, sorted(files), _manifest_bytes(files))
            except Exception as err:
                failure, original = _failure(err, url), err
        if failure is not None:
            with contextlib.suppress(Exception):
                store.delete(staging)
    failure = broadcast_from_rank_zero(failure)
    if failure is not None:
        raise failure from original


def _failure(error: BaseException, url: str) -> CheckpointWriteError:
    failure = write_error(error, PurePosixPath(url))
    failure.filename = url  # the URL as given (a path would fold its "//")
    return failure


# ------------------------------------------------------------------------------------------- loading
def _read(store: RemoteStore, name: str, size: int) -> bytes:
    """The object ``name`` (its first ``size`` + 1 bytes at most: an object longer than listed fails its check)."""
    path = f"{store.root}/{name}"
    try:
        return store.fs.cat_file(path, start=0, end=size + 1)
    except FileNotFoundError:
        raise CheckpointIntegrityError(f"{store.url_of(path)}: missing (the checkpoint is incomplete)") from None


def _manifest(store: RemoteStore) -> dict[str, Any]:
    where = store.url_of(f"{store.root}/{MANIFEST_FILE}")
    if not store.fs.exists(store.root) or not store.children(store.root):
        raise CheckpointNotFoundError(f"checkpoint not found: {store.url}")
    try:
        manifests.check_size(int(store.fs.info(f"{store.root}/{MANIFEST_FILE}")["size"]), where)
        data = store.fs.cat_file(f"{store.root}/{MANIFEST_FILE}", start=0, end=manifests.MAX_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointIntegrityError(
            f"{where}: missing, so {store.url} is not a complete checkpoint (a save that did not finish, or not a "
            "lightning-mm checkpoint); a checkpoint at a URL is complete once its manifest is written"
        ) from None
    return manifests.parse(data, where)


def _check_present(store: RemoteStore, manifest: dict[str, Any]) -> None:
    """Every listed object is there, of its size, and no ``.distcp`` object is there unlisted (nothing is read)."""
    files: dict[str, dict[str, Any]] = manifest["files"]
    present = {}
    for info in store.fs.ls(store.root, detail=True, refresh=True):
        present[posixpath.basename(info["name"].rstrip("/"))] = info
    foreign = sorted(n for n in present if n.endswith(_DCP_SUFFIX) and n not in files)
    if foreign:
        more = f"; nor {foreign[1:6]}{f' and {len(foreign) - 6} more' if len(foreign) > 6 else ''}"
        raise CheckpointIntegrityError(
            f"{store.url}/{foreign[0]}: not part of this checkpoint (its manifest does "
            f"not list it{more if len(foreign) > 1 else ''})"
        )
    for name, entry in sorted(files.items()):  # names and sizes first: the first mismatch ends the check
        where = f"{store.url}/{name}"
        if name not in present:
            raise CheckpointIntegrityError(f"{where}: missing (the checkpoint is incomplete)")
        size = int(present[name].get("size") or 0)
        if size != entry["size"]:
            state = "truncated" if size < entry["size"] else "longer than written"
            raise CheckpointIntegrityError(
                f"{where}: {state} ({size} bytes; the checkpoint's manifest records {entry['size']})"
            )


def _check_content(store: RemoteStore, manifest: dict[str, Any], full: bool, read: dict[str, bytes]) -> None:
    """The digest of every object (``read``: the objects already read) matches its entry; the first that does not
    ends the check."""
    files: dict[str, dict[str, Any]] = manifest["files"]
    version_1 = manifests.sampled_only(manifest)
    for name, entry in sorted(files.items()):
        path = f"{store.root}/{name}"
        if not version_1:  # every byte, always
            found = digest.bytes_digest(read[name]) if name in read else store.entry(path)[digest.FIELD]
            same = found == entry[digest.FIELD]
        elif name in read:
            same = _hash_bytes(read[name]) == entry["sha256"]
        elif full:
            same = store.sha256(path) == entry["sha256"]
        else:
            same = store.sample(path, entry["size"]) == entry["sample"]
        if not same:
            raise CheckpointIntegrityError(
                f"{store.url}/{name}: its content differs from the checkpoint's manifest: the object "
                "was altered or comes from another checkpoint"
            )


def _metadata(store: RemoteStore, data: bytes, files: Mapping[str, dict[str, Any]]) -> Metadata:
    where = f"{store.url}/.metadata"
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as err:
        raise CheckpointIntegrityError(f"{where}: truncated or corrupted ({type(err).__name__}: {err})") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{where}: expected DCP Metadata, found {type(metadata).__name__}")
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or name not in files:
            raise CheckpointIntegrityError(f"{where}: names {name!r}, which its manifest does not list")
        if not (
            isinstance(offset, int)
            and isinstance(length, int)
            and 0 <= offset
            and 0 <= length
            and offset + length <= files[name]["size"]
        ):
            raise CheckpointIntegrityError(f"{where}: invalid byte range for {index.fqn} in {name}")
    return metadata


def _meta(store: RemoteStore, data: bytes) -> dict[str, Any]:
    where = f"{store.url}/{META_FILE}"
    try:
        meta = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(f"{where}: not loadable weights_only ({unpickler_reason(err)})") from None
    except (EOFError, RuntimeError, ValueError, KeyError, IndexError, TypeError) as err:
        raise CheckpointIntegrityError(f"{where}: corrupted, not a readable torch file ({err})") from None
    if not isinstance(meta, dict):
        raise CheckpointIntegrityError(f"{where}: not a checkpoint's meta dict")
    return meta


def open_source(
    url: str, storage_options: Mapping[str, Any] | None = None, full_check: bool = True
) -> CheckpointSource:
    """Open the checkpoint at ``url`` (checked against its manifest first) as a :class:`.source.CheckpointSource`."""
    store = RemoteStore(url, storage_options)
    manifest = _manifest(store)
    for name in (".metadata", META_FILE):
        if name not in manifest["files"]:
            raise CheckpointIntegrityError(f"{store.url}/{name}: not listed in the checkpoint's {MANIFEST_FILE}")
    _check_present(store, manifest)  # before anything is read: the sizes read are the sizes listed
    read = {name: _read(store, name, manifest["files"][name]["size"]) for name in (".metadata", META_FILE)}
    _check_content(store, manifest, full_check, read)
    metadata = _metadata(store, read[".metadata"], manifest["files"])
    meta = _meta(store, read[META_FILE])
    shapes, dtypes = {}, {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            shapes[key], dtypes[key] = tuple(item.size), item.properties.dtype
    options = store.options

    def reader() -> Any:
        _, fsspec_reader = fsspec_storage()

        class Reader(fsspec_reader):  # type: ignore[misc, valid-type]
            def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
                storage_meta = getattr(metadata, "storage_meta", None)
                if storage_meta is not None:
                    storage_meta.load_id = self.load_id
                return metadata

        return Reader(store.url, **options)

    return CheckpointSource(url, meta, shapes, dtypes, is_dcp=True, reader=reader)


def remove(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Delete the checkpoint at ``url``: its manifest first (it stops being complete), then its objects."""
    store = RemoteStore(url, storage_options)
    try:
        store.delete(store.root)
    except OSError as err:
        raise CheckpointWriteError(err.errno or errno.EIO, f"removing the checkpoint failed: {err}", url) from None


# ------------------------------------------------------------------------------------------- copying
def download(
    url: str, directory: Any, storage_options: Mapping[str, Any] | None = None, checkpoint: bool = True
) -> None:
    """Copy what ``url`` holds into the new local ``directory`` (the converters read it there). A ``checkpoint``
    (``torch_dcp``) is checked against its manifest first, every object hashed whole; a Hugging Face directory
    (``checkpoint=False``) is copied as it is, its top-level objects only."""
    store = RemoteStore(url, storage_options)
    if checkpoint:
        open_source(url, storage_options, full_check=True)
        names = [*_manifest(store)["files"], MANIFEST_FILE]
    else:
        if not store.fs.isdir(store.root):
            raise CheckpointNotFoundError(f"not found: {store.url} (a directory of Hugging Face files)")
        names = sorted(
            posixpath.basename(p["name"]) for p in store.fs.ls(store.root, detail=True) if p.get("type") == "file"
        )
    for name in names:
        if not is_plain_file_name(name):
            raise CheckpointIntegrityError(f"{store.url}: names {name!r}, not a plain file name")
        store.fs.get_file(f"{store.root}/{name}", str(directory / name))


def upload(local: Any, url: str, storage_options: Mapping[str, Any] | None = None, force: bool = False) -> None:
    """Copy a converter's local output (a file, or a directory of files) to ``url``: staged first, then committed
    by copying, the directory's ``manifest.json`` (else its ``config.json``) last. An existing ``url`` is refused
    unless ``force``."""
    store = RemoteStore(url, storage_options)
    if store.fs.exists(store.root) and not force:
        raise OutputExistsError(f"output exists: {store.url} (add --force to replace it)")
    store.remove_abandoned()
    staging = store.staging()
    try:
        if local.is_file():
            store.fs.put_file(str(local), staging)
            if store.fs.exists(store.root):
                store.delete(store.root)
            store.fs.copy(staging, store.root)
            store.fs.rm_file(staging)
            return
        names = sorted(p.name for p in local.iterdir() if p.is_file())
        last = MANIFEST_FILE if MANIFEST_FILE in names else "config.json" if "config.json" in names else None
        for name in names:
            store.fs.put_file(str(local / name), f"{staging}/{name}")
        if store.fs.exists(store.root):
            store.delete(store.root)
        for name in [n for n in names if n != last] + ([last] if last else []):
            store.fs.copy(f"{staging}/{name}", f"{store.root}/{name}")
        store.delete(staging)
    except Exception:
        with contextlib.suppress(Exception):
            store.delete(staging)
        raise
