"""The manifest of a ``torch`` format checkpoint: one more record in the file's own zip archive.

``torch.save`` writes a zip archive of uncompressed records (``<archive>/data.pkl``, ``<archive>/data/0``, ...).
:func:`append` adds ``<archive>/lightning_mm_manifest.json`` after them (the archive stays one file that
``torch.load`` reads as before; it ignores records it does not know)::

    {"manifest": "lightning-mm torch file", "version": 1, "hash": "xxh3_128 of 16 MiB chunks",
     "records": {"archive/data.pkl": {"size": 253, "xxh3_128": "..."}, "archive/data/0": {...}, ...}}

:func:`verify`, before anything is unpickled: the manifest record is whole (its zip CRC-32), the records are
exactly those it lists, of their sizes, and the digest of each record (:mod:`.digest`; the ones named in
``hashed``, all by default) matches. A torch file without this record (another Lightning strategy's, an older
lightning-mm's, ``torch.save``'s) is checked against the CRC-32 that ``torch.save`` records for each record
instead, so that every byte of it is checked too. A mismatch is a :class:`CheckpointIntegrityError` naming the
file and the record.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from collections.abc import Container
from pathlib import Path
from typing import Any

from lightning_mm.checkpoint import digest
from lightning_mm.checkpoint.errors import CheckpointIntegrityError

__all__ = ["RECORD", "append", "verify", "records", "sizes"]

RECORD = "lightning_mm_manifest.json"
_KIND = "lightning-mm torch file"
_VERSION = 1
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_CHUNK = 16 << 20


def _infos(path: Path) -> list[zipfile.ZipInfo]:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointIntegrityError(
            f"{path}: truncated or corrupted, not a readable torch file ({type(error).__name__}: {error})"
        ) from None


def records(path: Path) -> dict[str, tuple[int, int, zipfile.ZipInfo]]:
    """Each record of the archive: ``(offset of its data, size, info)``."""
    out = {}
    with open(path, "rb") as f:
        for info in _infos(path):
            header = os.pread(f.fileno(), _LOCAL_HEADER.size, info.header_offset)
            if len(header) < _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != b"PK\x03\x04":
                raise CheckpointIntegrityError(f"{path}: record {info.filename} has no valid header (corrupted)")
            _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
            out[info.filename] = (
                info.header_offset + _LOCAL_HEADER.size + name_length + extra_length,
                info.file_size,
                info,
            )
    return out


def append(path: Path) -> None:
    """Add the manifest record to the torch file at ``path`` (just written, not yet visible)."""
    found = records(path)
    names = sorted(found)
    entries = digest.parallel(
        lambda name: (
            name,
            {"size": found[name][1], digest.FIELD: digest.range_digest(path, found[name][0], found[name][1])},
        ),
        names,
    )
    archive = names[0].split("/", 1)[0] if names and "/" in names[0] else "archive"
    body = {"manifest": _KIND, "version": _VERSION, "hash": digest.NAME, "records": dict(entries)}
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(f"{archive}/{RECORD}", json.dumps(body, indent=1))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _crc32(path: Path, offset: int, size: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        for start in range(offset, offset + size, _CHUNK):
            crc = zlib.crc32(os.pread(f.fileno(), min(_CHUNK, offset + size - start), start), crc)
    return crc


def _read_manifest(path: Path, found: dict[str, tuple[int, int, zipfile.ZipInfo]]) -> dict[str, Any] | None:
    names = [n for n in found if n.rsplit("/", 1)[-1] == RECORD]
    if not names:
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            body = json.loads(archive.read(names[0]))  # zipfile checks the record's CRC-32
    except (zipfile.BadZipFile, UnicodeDecodeError, json.JSONDecodeError, OSError) as error:
        raise CheckpointIntegrityError(f"{path}: its manifest record {names[0]} is corrupted ({error})") from None
    if not isinstance(body, dict) or body.get("manifest") != _KIND or not isinstance(body.get("records"), dict):
        raise CheckpointIntegrityError(f"{path}: {names[0]} is not a lightning-mm manifest")
    if body.get("version") != _VERSION or body.get("hash") != digest.NAME:
        raise CheckpointIntegrityError(
            f"{path}: manifest version {body.get('version')!r} / hash "
            f"{body.get('hash')!r} is not one this lightning-mm reads"
        )
    del found[names[0]]
    return body


def verify(path: Path, hashed: Container[str] | None = None) -> dict[str, Any] | None:
    """Check the torch file ``path`` (see the module docstring); its manifest, or None for a file without one (then
    checked by its zip CRC-32s). ``hashed``: the records this rank checks the content of (all when None)."""
    found = records(path)
    body = _read_manifest(path, found)
    if body is not None:
        listed: dict[str, Any] = body["records"]
        for name in sorted(set(found) | set(listed)):
            if name not in listed:
                raise CheckpointIntegrityError(f"{path}: record {name} is not in the file's manifest (altered)")
            if name not in found:
                raise CheckpointIntegrityError(f"{path}: record {name} of the manifest is missing (altered)")
            entry = listed[name]
            if not isinstance(entry, dict) or entry.get("size") != found[name][1]:
                raise CheckpointIntegrityError(
                    f"{path}: record {name} has {found[name][1]} bytes, the manifest "
                    f"records {entry.get('size') if isinstance(entry, dict) else entry}"
                )
    todo = sorted(n for n in found if hashed is None or n in hashed)

    def check(name: str) -> None:
        offset, size, info = found[name]
        if body is not None:
            same = digest.range_digest(path, offset, size) == body["records"][name].get(digest.FIELD)
        else:
            same = info.compress_type == zipfile.ZIP_STORED and _crc32(path, offset, size) == info.CRC
        if not same:
            what = "its manifest" if body is not None else "the CRC-32 torch.save recorded"
            raise CheckpointIntegrityError(
                f"{path}: record {name} differs from {what}: the file was altered or damaged"
            )

    digest.parallel(check, todo)
    return body


def sizes(path: Path) -> dict[str, int]:
    """The size of each record (what :func:`digest.assign` splits over the ranks)."""
    return {name: size for name, (_, size, _) in records(path).items() if name.rsplit("/", 1)[-1] != RECORD}
