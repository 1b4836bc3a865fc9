"""Binding every file of a ``torch_dcp`` checkpoint to that checkpoint: ``manifest.json``, written last.

Each rank hashes the files it wrote (:class:`RecordingFileSystem` notes them); rank 0 adds ``.metadata`` and
``meta.pt`` and writes the manifest just before the checkpoint is renamed into place::

    {"manifest": "lightning-mm checkpoint", "version": 2, "id": "...", "hash": "xxh3_128 of 16 MiB chunks",
     "files": {"__0_0.distcp": {"size": 1234, "xxh3_128": "..."}, ...}}

:func:`verify` checks a checkpoint before anything is unpickled from it, on every load: every listed file is
present, a regular file inside the directory, of its recorded size, and no ``.distcp`` file is there that the
manifest does not list; and the digest of every whole file (:mod:`.digest`) matches, so every byte a load reads
has been checked. A distributed load splits the hashing over the ranks (``hashed``: the files this rank hashes)
and the ranks agree on the outcome (``store.load``). A file from another run, a missing, truncated, extended or
altered one fails, naming the file. A ``.metadata`` or ``meta.pt`` that differs from its entry but is whole in its
own format (a pickle that ends where the file ends, a zip archive with its central directory) is reported as a
file of another checkpoint or run, not as truncated or altered.

Version 1 manifests (lightning-mm before full checks on load) recorded SHA-256 and a sampled fingerprint (the
size and 4 blocks of 64 KiB): a load checks their sample only (:func:`sampled_only`; the loader warns),
``full=True`` (the converters) the SHA-256 too.

Reading a manifest is bounded before anything is parsed (:func:`parse`): a checkpoint lists at most
:data:`MAX_FILES` files (DCP writes one shard per rank and writer thread, plus a few files of rank 0), and one
entry takes at most :data:`ENTRY_BYTES` bytes as written (a file name of at most 255 bytes, its size and its
digests), so a manifest of more than :data:`MAX_BYTES` (32 MiB) is refused from its size alone, and one listing
more files is refused before any of them is checked. :func:`verify` then checks the names and sizes of every
file, in order, and stops at the first mismatch, before hashing any; the hashing stops at its first mismatch too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickletools
import re
import uuid
import zipfile
from collections.abc import Container, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_mm._utils.model_files import is_plain_file_name
from lightning_mm.checkpoint import digest
from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError

__all__ = [
    "MANIFEST_FILE",
    "MAX_FILES",
    "ENTRY_BYTES",
    "MAX_BYTES",
    "check_size",
    "parse",
    "manifest_body",
    "RecordingFileSystem",
    "file_entries",
    "write_manifest",
    "read_manifest",
    "verify",
    "check_name",
    "inside",
    "sampled_only",
    "shard_rank",
]

MANIFEST_FILE = "manifest.json"
_KIND = "lightning-mm checkpoint"
_VERSION = 2
_BLOCKS, _BLOCK_SIZE = 4, 64 * 1024
_CHUNK = 16 << 20
_HASH = digest.NAME
_V1_HASH = "sha256 of 16 MiB chunks"  # version 1: SHA-256 and a sampled fingerprint per file
_HASHES = {1: _V1_HASH, 2: _HASH}
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
_DCP_SUFFIX = ".distcp"
_NAME_MAX = 255  # bytes in a file name (NAME_MAX of Linux and macOS file systems)

MAX_FILES = 1 << 16
"""The most files a checkpoint's manifest may list: DCP writes one shard per rank (and writer thread), so 65,536
covers a run of tens of thousands of ranks."""
ENTRY_BYTES = 512
"""The most bytes one entry of a manifest takes as written: a file name of at most 255 bytes, its size and its
digests (version 1: a SHA-256 and a sample fingerprint), indented."""
MAX_BYTES = MAX_FILES * ENTRY_BYTES
"""The largest manifest read (32 MiB): a larger one is refused before it is read."""


class RecordingFileSystem(FileSystem):
    """DCP's local file system that notes each file opened for writing (so its writer can hash it afterwards)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[Path] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" in mode:
            self.written.append(Path(path))  # list.append is atomic: DCP may write from several threads
        with super().create_stream(path, mode) as stream:
            yield stream


# ------------------------------------------------------------------------------------------- hashing
def _sample_offsets(size: int, blocks: int, block_size: int) -> list[int]:
    if size <= blocks * block_size:
        return [0]
    last = size - block_size
    return [last * k // (blocks - 1) for k in range(blocks)]


def _sample(path: Path, size: int, blocks: int = _BLOCKS, block_size: int = _BLOCK_SIZE) -> str:
    """SHA-256 of the size and of ``blocks`` blocks at fixed places (the whole file when it is small)."""
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    whole = size <= blocks * block_size
    with path.open("rb") as f:
        for offset in _sample_offsets(size, blocks, block_size):
            f.seek(offset)
            digest.update(f.read(size if whole else block_size))
    return digest.hexdigest()


def _chunk_digest(path: Path, offset: int) -> bytes:
    with path.open("rb") as f:
        return hashlib.sha256(os.pread(f.fileno(), _CHUNK, offset)).digest()  # releases the GIL while hashing


def _sha256(path: Path) -> str:
    """SHA-256 over the size and the SHA-256 of each 16 MiB chunk (chunks hash in parallel threads)."""
    size = path.stat().st_size
    digests = digest.parallel(lambda offset: _chunk_digest(path, offset), range(0, size, _CHUNK))
    return hashlib.sha256(size.to_bytes(8, "little") + b"".join(digests)).hexdigest()


def _entry(path: Path) -> tuple[str, dict[str, Any]]:
    return path.name, {"size": path.stat().st_size, digest.FIELD: digest.file_digest(path)}


def shard_rank(name: str) -> int | None:
    """The rank that wrote DCP shard ``__<rank>_<n>.distcp`` (and reads it back on the same world size)."""
    match = _SHARD.match(name)
    return int(match[1]) if match else None


def sampled_only(manifest: Mapping[str, Any]) -> bool:
    """True for a version 1 manifest, whose files a load checks by a sample only."""
    return int(manifest.get("version", 1)) < 2


def file_entries(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """Size and digest of each file that exists (``.tmp`` files renamed since are skipped)."""
    existing = sorted({Path(p) for p in paths if Path(p).is_file()})
    return dict(digest.parallel(_entry, existing))


def manifest_body(files: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest (version 2) of ``files`` (each name's size and digest), as written (also at a URL)."""
    return {
        "manifest": _KIND,
        "version": _VERSION,
        "id": uuid.uuid4().hex,
        "hash": _HASH,
        "files": dict(sorted(files.items())),
    }


def write_manifest(directory: Path, entries: Iterable[Mapping[str, dict[str, Any]]], extra: Iterable[str]) -> None:
    """Write ``directory/manifest.json`` from the entries every rank hashed plus the files named in ``extra``."""
    files: dict[str, dict[str, Any]] = {}
    for part in entries:
        files.update(part or {})
    files.update(file_entries(directory / name for name in extra))
    with open(directory / MANIFEST_FILE, "w") as f:
        json.dump(manifest_body(files), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------- reading
def check_name(directory: Path, name: Any, what: str) -> Path:
    """``directory/name`` for a plain file name; anything that could lead outside ``directory`` is refused."""
    if not is_plain_file_name(name):
        raise CheckpointIntegrityError(
            f"{directory}: {what} names {name!r}, which is not a file of the checkpoint "
            "directory (a checkpoint never refers to files outside itself)"
        )
    return directory / name


def inside(directory: Path, path: Path) -> Path:
    """``path`` if it is a regular file (not a link) inside ``directory``; a clear error otherwise."""
    if path.is_symlink():
        raise CheckpointIntegrityError(
            f"{path}: is a symbolic link (to {os.readlink(path)}); checkpoint files "
            "are regular files inside the checkpoint directory"
        )
    if not path.exists():
        raise CheckpointIntegrityError(f"{path}: missing (the checkpoint is incomplete)")
    if not path.is_file():
        raise CheckpointIntegrityError(f"{path}: not a regular file")
    if path.resolve().parent != directory.resolve():
        raise CheckpointIntegrityError(f"{path}: resolves outside the checkpoint directory {directory}")
    return path


def check_size(size: int, where: str) -> None:
    """Refuse a manifest of ``size`` bytes above :data:`MAX_BYTES` (before it is read)."""
    if size > MAX_BYTES:
        raise CheckpointIntegrityError(
            f"{where}: {size} bytes, more than a manifest may have ({MAX_BYTES} bytes: at most {MAX_FILES} files of "
            f"at most {ENTRY_BYTES} bytes each); refused without reading it"
        )


def parse(data: bytes, where: str) -> dict[str, Any]:
    """The manifest in ``data`` (read from ``where``, named in every error), checked: its kind, version and hash,
    at most :data:`MAX_FILES` entries, each a plain file name with its size and digests."""
    check_size(len(data), where)
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:  # ValueError: JSON, or an int too long
        raise CheckpointIntegrityError(f"{where}: not a valid manifest ({type(error).__name__}: {error})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("manifest") != _KIND
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointIntegrityError(f"{where}: not a lightning-mm checkpoint manifest")
    version = manifest.get("version", 1)
    if not isinstance(version, int) or version < 1:
        raise CheckpointIntegrityError(f"{where}: invalid manifest version {version!r}")
    if version > _VERSION:
        raise CheckpointIntegrityError(
            f"{where}: manifest version {manifest['version']} is newer than this lightning-mm reads ({_VERSION})"
        )
    if manifest.get("hash") != _HASHES[version]:
        raise CheckpointIntegrityError(
            f"{where}: unknown hash {manifest.get('hash')!r} (this lightning-mm uses "
            f"{_HASHES[version]} in version {version} manifests)"
        )
    files = manifest["files"]
    if len(files) > MAX_FILES:
        raise CheckpointIntegrityError(
            f"{where}: lists {len(files)} files, more than a checkpoint may have ({MAX_FILES})"
        )
    fields = ("sha256", "sample") if version == 1 else (digest.FIELD,)
    for name, entry in files.items():
        if not is_plain_file_name(name) or len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX:
            raise CheckpointIntegrityError(
                f"{where}: names {name[:300]!r}, which is not a file of the checkpoint directory (a checkpoint "
                "never refers to files outside itself)"
            )
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or entry["size"] < 0
            or not all(isinstance(entry.get(k), str) for k in fields)
        ):
            raise CheckpointIntegrityError(f"{where}: malformed entry for {name}")
    return manifest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The parsed manifest of ``directory``, or None for a checkpoint written without one; one larger than
    :data:`MAX_BYTES` is refused from its size, before it is read."""
    file = directory / MANIFEST_FILE
    if not file.exists() and not file.is_symlink():
        return None
    inside(directory, file)
    with file.open("rb") as f:
        check_size(os.fstat(f.fileno()).st_size, str(file))
        data = f.read(MAX_BYTES + 1)  # bounded, should it grow meanwhile
    return parse(data, str(file))


def _complete_file(path: Path) -> str | None:
    """What ``path`` is when it is a whole file of its kind (a DCP ``.metadata`` pickle that ends where the file
    ends, a ``.pt`` zip archive with its central directory); None when it is not, or its kind has no such test
    (``.distcp`` shards are raw bytes). Nothing is unpickled or loaded."""
    if path.name == ".metadata":
        try:
            with path.open("rb") as f:
                data = f.read()
            end = None
            for opcode, _, position in pickletools.genops(data):
                if opcode.name == "STOP" and position is not None:  # always an offset when reading bytes
                    end = position + 1
        except (OSError, ValueError, EOFError):
            return None
        return "DCP .metadata" if end == len(data) else None
    if path.suffix == ".pt":  # torch.save writes no archive comment: the end record is the file's last 22 bytes
        try:
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - 22))
                ends_as_zip = f.read(4) == b"PK\x05\x06"
        except OSError:
            return None
        return "torch file" if ends_as_zip and zipfile.is_zipfile(path) else None
    return None


def _not_ours(path: Path, size: int, entry: dict[str, Any]) -> CheckpointIntegrityError | None:
    kind = _complete_file(path)
    if kind is None:
        return None
    return CheckpointIntegrityError(
        f"{path}: does not belong to this checkpoint: a complete {kind} of {size} bytes that is not the one its "
        f"{MANIFEST_FILE} records ({entry['size']} bytes, another content), i.e. the file of another checkpoint or run"
    )


def _differs(path: Path, size: int, entry: dict[str, Any], sample: dict[str, int] | None, full: bool) -> bool:
    """Whether the content of ``path`` differs from its entry: its whole digest (``full``) or, for a version 1
    entry (``sample`` given), its sampled fingerprint and (``full``) its SHA-256."""
    if sample is None:
        return full and digest.file_digest(path) != entry[digest.FIELD]
    return _sample(path, size, sample["blocks"], sample["block_size"]) != entry["sample"] or (
        full and _sha256(path) != entry["sha256"]
    )


def _check_present(directory: Path, name: str, entry: dict[str, Any]) -> int:
    """The size of file ``name``: a regular file inside ``directory`` of the size its entry records."""
    path = inside(directory, directory / name)
    size = path.stat().st_size
    if size != entry["size"]:
        foreign = _not_ours(path, size, entry)
        if foreign is not None:
            raise foreign
        state = "truncated" if size < entry["size"] else "longer than written"
        raise CheckpointIntegrityError(
            f"{path}: {state} ({size} bytes; the checkpoint's manifest records {entry['size']})"
        )
    return size


def _check_content(
    directory: Path, name: str, entry: dict[str, Any], size: int, sample: dict[str, int] | None, full: bool
) -> None:
    path = directory / name
    if _differs(path, size, entry, sample, full):
        foreign = _not_ours(path, size, entry)
        if foreign is not None:
            raise foreign
        raise CheckpointIntegrityError(
            f"{path}: its content differs from the checkpoint's manifest: the file was "
            "altered or comes from another checkpoint"
        )


def verify(directory: Path, full: bool = False, hashed: Container[str] | None = None) -> dict[str, Any] | None:
    """Check the files of ``directory`` against its manifest (see the module docstring); None without one.

    The whole digest of every file named in ``hashed`` (every file when None) is compared; ``full`` does it for a
    version 1 manifest too (its SHA-256), whose files are otherwise checked by sample only.
    """
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    files: dict[str, dict[str, Any]] = manifest["files"]
    sample = None
    if sampled_only(manifest):
        raw = manifest.get("sample") or {}
        try:
            sample = {"blocks": int(raw.get("blocks", _BLOCKS)), "block_size": int(raw.get("block_size", _BLOCK_SIZE))}
        except (AttributeError, TypeError, ValueError):
            sample = {"blocks": 0, "block_size": 0}
        if not 2 <= sample["blocks"] <= 64 or not 1 <= sample["block_size"] <= 1 << 20:
            raise CheckpointIntegrityError(f"{directory / MANIFEST_FILE}: invalid sample settings {raw!r:.200}")
    foreign = sorted(p.name for p in directory.iterdir() if p.name.endswith(_DCP_SUFFIX) and p.name not in files)
    if foreign:
        more = f"; nor {foreign[1:6]}{f' and {len(foreign) - 6} more' if len(foreign) > 6 else ''}"
        raise CheckpointIntegrityError(
            f"{directory / foreign[0]}: not part of this checkpoint (its manifest does not "
            f"list it{more if len(foreign) > 1 else ''})"
        )
    entries = sorted(files.items())
    sizes = [_check_present(directory, name, entry) for name, entry in entries]  # stops at the first mismatch
    digest.parallel(
        lambda item: _check_content(
            directory,
            item[0][0],
            item[0][1],
            item[1],
            sample,
            full or (sample is None and (hashed is None or item[0][0] in hashed)),
        ),
        list(zip(entries, sizes)),
    )
    return manifest
