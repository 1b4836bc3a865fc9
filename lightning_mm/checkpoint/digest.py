"""Digests of whole files and of byte ranges, for checking every byte a load reads.

A digest is the XXH3-128 of the length and of the XXH3-128 of each 16 MiB chunk (chunks hash in parallel threads:
``xxhash`` releases the GIL). XXH3 hashes at several GB/s per core, a few times faster than SHA-256 (about 1.3
GB/s here), so that checking a whole checkpoint costs a fraction of reading it (``benchmarks/README.md``). It is
a check against damage (bit rot, half-copied files, a file of another run), not against a forger who can rewrite
the manifest too.

:func:`parallel` stops at the first failure: the items not yet started are cancelled, so that one bad file does
not cost the hashing of all the others. :class:`StreamDigest` gives the same digest for bytes read in pieces (an
object of a remote store). :func:`assign` splits the files to hash over the ranks of a distributed load, so that
each byte is hashed once.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import xxhash

__all__ = ["NAME", "FIELD", "range_digest", "file_digest", "StreamDigest", "bytes_digest", "parallel", "assign"]

NAME = "xxh3_128 of 16 MiB chunks"
FIELD = "xxh3_128"
_CHUNK = 16 << 20
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # Linux, macOS


def parallel(function: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """``[function(item) for item in items]`` in up to 8 threads; the first exception is raised once the calls
    already running have returned, and the calls not yet started are cancelled (never run)."""
    items = list(items)
    if len(items) <= 1:
        return [function(item) for item in items]
    pool = ThreadPoolExecutor(max_workers=min(8, len(items), os.cpu_count() or 1))
    try:
        futures = [pool.submit(function, item) for item in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        error = next((f.exception() for f in futures if f in done and f.exception() is not None), None)
        if error is not None:
            for future in futures:
                future.cancel()
            raise error
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def range_digest(path: Path, offset: int, length: int) -> str:
    """The digest of ``length`` bytes of ``path`` from ``offset`` (fewer if the file ends before).

    The file is memory-mapped: the page cache is hashed in place, with no copy into a buffer; each 16 MiB chunk is
    dropped from the mapping once hashed, so that the resident set does not grow with the file."""
    with open(path, "rb") as f:
        end = min(offset + length, os.fstat(f.fileno()).st_size)
        if end <= offset:
            return _combine(length, [])
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)

            def chunk(start: int) -> bytes:
                stop = min(start + _CHUNK, end)
                value = xxhash.xxh3_128(view[start:stop]).digest()
                if _DONTNEED is not None:
                    first = start - start % mmap.PAGESIZE
                    mapped.madvise(_DONTNEED, first, stop - first)
                return value

            try:
                digests = parallel(chunk, range(offset, end, _CHUNK))
            finally:
                view.release()
    return _combine(length, digests)


def _combine(length: int, digests: list[bytes]) -> str:
    return xxhash.xxh3_128(length.to_bytes(8, "little") + b"".join(digests)).hexdigest()


def file_digest(path: Path) -> str:
    return range_digest(path, 0, path.stat().st_size)


class StreamDigest:
    """The digest of bytes given in pieces of any size (:meth:`update`): equal to :func:`range_digest` of the
    same bytes in a file. For objects read from a store as a stream."""

    def __init__(self) -> None:
        self._digests: list[bytes] = []
        self._chunk = xxhash.xxh3_128()
        self._filled = 0
        self.length = 0

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), _CHUNK - self._filled)
            self._chunk.update(view[:take])
            self._filled += take
            self.length += take
            view = view[take:]
            if self._filled == _CHUNK:
                self._digests.append(self._chunk.digest())
                self._chunk, self._filled = xxhash.xxh3_128(), 0

    def hexdigest(self) -> str:
        return _combine(self.length, self._digests + ([self._chunk.digest()] if self._filled else []))


def bytes_digest(data: bytes) -> str:
    """The digest of ``data`` (as :func:`range_digest` of a file holding it)."""
    stream = StreamDigest()
    stream.update(data)
    return stream.hexdigest()


def assign(
    sizes: Mapping[str, int], rank: int, world: int, prefer: Callable[[str], int | None] = lambda name: None
) -> set[str]:
    """The names this rank hashes: each name goes to one rank, the one ``prefer`` names where there is one (a DCP
    shard to the rank that reads it on the same world size), the others largest first to the least loaded rank.
    Every rank gets the same answer for the same ``sizes``."""
    if world <= 1:
        return set(sizes)
    load = [0] * world
    owners: dict[str, int] = {}
    for name, size in sizes.items():
        owner = prefer(name)
        if owner is not None and 0 <= owner < world:
            owners[name] = owner
            load[owner] += size
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        if name not in owners:
            owners[name] = min(range(world), key=lambda r: (load[r], r))
            load[owners[name]] += size
    return {name for name, owner in owners.items() if owner == rank}
