"""Bounded resources for tests of hostile input: a failure must be a quick error, never a machine that swaps."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator

_PAGE = resource.getpagesize()


def _address_space() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * _PAGE


@contextlib.contextmanager
def bounded(extra_bytes: int = 1 << 30, seconds: int = 30) -> Iterator[None]:
    """Run the body with at most ``extra_bytes`` more address space and ``seconds`` of wall time.

    Going over the memory cap raises ``MemoryError`` inside the body; going over the time raises ``TimeoutError``.
    Both limits are lifted again on exit (only the soft memory limit is lowered, so it can be restored).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + extra_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)

    def _timeout(signum: int, frame: object) -> None:
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, _timeout)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)
