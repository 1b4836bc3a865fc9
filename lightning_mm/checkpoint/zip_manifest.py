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

Before that, the file's exact length and layout (:func:`layout`): its end record is its last 22 bytes, and its
bytes are exactly the records (each local header, its data and the data descriptor ``torch.save`` writes after it)
one after the other from byte 0, then the central directory, then the end records; a file with bytes appended,
inserted or prepended is a :class:`CheckpointIntegrityError` though every record is whole. The number of records
(at most :data:`MAX_RECORDS`) and the size of the central directory are bounded before the archive is parsed, and
the size of the manifest record before it is read.
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
from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError

__all__ = ["RECORD", "MAX_RECORDS", "RECORD_BYTES", "append", "verify", "layout", "records", "sizes"]

RECORD = "lightning_mm_manifest.json"
_KIND = "lightning-mm torch file"
_VERSION = 1
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_CHUNK = 16 << 20
_END = struct.Struct("<4s4H2LH")  # signature, disks, entries here, entries, directory size, offset, comment length
_END64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end record, disks
_END64 = struct.Struct("<4sQ2H2L4Q")  # signature, size, versions, disks, entries here, entries, size, offset
_DESCRIPTORS = (struct.Struct("<4sLLL"), struct.Struct("<4sLQQ"), struct.Struct("<LLL"), struct.Struct("<LQQ"))

MAX_RECORDS = 1 << 17
"""The most records a torch file may have: ``torch.save`` writes one per tensor storage and 5 more."""
RECORD_BYTES = 384
"""The most bytes one record takes in the central directory, or in the manifest record: a name of at most 255
bytes (``<archive>/data/<n>``) with its sizes, offsets and digest."""


def _infos(path: Path) -> list[zipfile.ZipInfo]:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointIntegrityError(
            f"{path}: truncated or corrupted, not a readable torch file ({type(error).__name__}: {error})"
        ) from None


def _directory(path: Path, size: int) -> tuple[int, int, int]:
    """``(offset, size, entries)`` of the central directory, from the end records; the file must end with them,
    and the directory must end where they begin."""
    with open(path, "rb") as f:
        end = os.pread(f.fileno(), _END.size, max(0, size - _END.size))
        if len(end) < _END.size or end[:4] != b"PK\x05\x06" or _END.unpack(end)[-1] != 0:
            tail = os.pread(f.fileno(), min(size, (64 << 10) + _END.size), max(0, size - (64 << 10) - _END.size))
            found = tail.rfind(b"PK\x05\x06")
            if found < 0 or len(tail) - found < _END.size:
                raise CheckpointIntegrityError(
                    f"{path}: truncated or corrupted, not a readable torch file (it does not end with a zip end "
                    "record; or bytes were appended after it)"
                )
            archive_end = size - len(tail) + found + _END.size + _END.unpack(tail[found : found + _END.size])[-1]
            raise CheckpointIntegrityError(
                f"{path}: {size} bytes, but its archive ends at byte {archive_end}: bytes were appended to the file "
                "that was written (altered)"
            )
        _, _, _, _, entries, directory_size, directory_offset, _ = _END.unpack(end)
        directory_end = size - _END.size
        locator = os.pread(f.fileno(), _END64_LOCATOR.size, max(0, directory_end - _END64_LOCATOR.size))
        zip64 = len(locator) == _END64_LOCATOR.size and locator[:4] == b"PK\x06\x07"  # torch.save writes them
        if zip64 or 0xFFFF == entries or 0xFFFFFFFF in (directory_size, directory_offset):
            if not zip64:
                raise CheckpointIntegrityError(f"{path}: truncated or corrupted, not a readable torch file (zip64)")
            where = _END64_LOCATOR.unpack(locator)[2]
            record = os.pread(f.fileno(), _END64.size, where)
            if len(record) < _END64.size or record[:4] != b"PK\x06\x06":
                raise CheckpointIntegrityError(
                    f"{path}: its zip64 end record is not at byte {where}, where its locator says: bytes were "
                    "inserted or removed (altered)"
                )
            fields = _END64.unpack(record)
            if where + 12 + fields[1] != directory_end - _END64_LOCATOR.size:
                raise CheckpointIntegrityError(f"{path}: bytes were inserted before its end records (altered)")
            entries, directory_size, directory_offset, directory_end = fields[7], fields[8], fields[9], where
    if entries > MAX_RECORDS or directory_size > entries * RECORD_BYTES:
        raise CheckpointIntegrityError(
            f"{path}: {entries} records in a central directory of {directory_size} bytes, more than a torch file may "
            f"have (at most {MAX_RECORDS} records of at most {RECORD_BYTES} bytes each)"
        )
    if directory_offset + directory_size != directory_end:
        raise CheckpointIntegrityError(
            f"{path}: its central directory ({directory_size} bytes from byte {directory_offset}) does not end where "
            f"its end records begin (byte {directory_end}): bytes were inserted or removed (altered)"
        )
    return directory_offset, directory_size, entries


def _descriptor(fd: int, offset: int, info: zipfile.ZipInfo) -> int:
    """The length of the data descriptor at ``offset`` that ends ``info``'s record (0 when it has none)."""
    if not info.flag_bits & 0x08:
        return 0
    raw = os.pread(fd, 24, offset)
    for form in _DESCRIPTORS:
        if len(raw) < form.size:
            continue
        fields = form.unpack(raw[: form.size])
        if form.format.startswith("<4s"):
            if fields[0] != b"PK\x07\x08":
                continue
            fields = fields[1:]
        if tuple(fields) == (info.CRC, info.compress_size, info.file_size):
            return form.size
    return -1


def layout(path: Path) -> dict[str, tuple[int, int, zipfile.ZipInfo]]:
    """The records of the torch file ``path`` (as :func:`records`), once its exact length and layout are checked
    (see the module docstring)."""
    size = path.stat().st_size
    directory_offset, _, entries = _directory(path, size)
    found = records(path)
    if len(found) != entries:
        raise CheckpointIntegrityError(f"{path}: {len(found)} records, its end record counts {entries} (altered)")
    position = 0
    with open(path, "rb") as f:
        for offset, _, info in sorted(found.values(), key=lambda item: item[2].header_offset):
            if info.header_offset != position:
                raise CheckpointIntegrityError(
                    f"{path}: record {info.filename} starts at byte {info.header_offset}, not at byte {position} "
                    "where the record before it ends: bytes were inserted (altered)"
                )
            descriptor = _descriptor(f.fileno(), offset + info.compress_size, info)
            if descriptor < 0:
                raise CheckpointIntegrityError(f"{path}: record {info.filename} has no valid data descriptor (altered)")
            position = offset + info.compress_size + descriptor
    if position != directory_offset:
        raise CheckpointIntegrityError(
            f"{path}: its records end at byte {position}, its central directory starts at byte {directory_offset}: "
            "bytes were inserted (altered)"
        )
    return found


def records(path: Path) -> dict[str, tuple[int, int, zipfile.ZipInfo]]:
    """Each record of the archive: ``(offset of its data, size, info)``."""
    out = {}
    with open(path, "rb") as f:
        for info in _infos(path):
            header = os.pread(f.fileno(), _LOCAL_HEADER.size, info.header_offset)
            if len(header) < _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != b"PK\x03\x04":
                raise CheckpointIntegrityError(f"{path}: record {info.filename} has no valid header (corrupted)")
            _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
            if info.filename in out:
                raise CheckpointIntegrityError(f"{path}: record {info.filename} is there twice (altered)")
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
    if found[names[0]][1] > MAX_RECORDS * RECORD_BYTES:
        raise CheckpointIntegrityError(
            f"{path}: its manifest record {names[0]} has {found[names[0]][1]} bytes, more than a manifest may have "
            f"({MAX_RECORDS * RECORD_BYTES} bytes: at most {MAX_RECORDS} records of at most {RECORD_BYTES} bytes "
            "each); refused without reading it"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            body = json.loads(archive.read(names[0]))  # zipfile checks the record's CRC-32
    except (zipfile.BadZipFile, UnicodeDecodeError, ValueError, RecursionError, OSError) as error:
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
    found = layout(path)
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
    return {name: size for name, (_, size, _) in layout(path).items() if name.rsplit("/", 1)[-1] != RECORD}
