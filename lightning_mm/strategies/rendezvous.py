"""The rendezvous store of a single-node run, listening on the loopback interface only.

``torch.distributed.init_process_group("env://")`` starts a TCPStore server that listens on every interface of the
launching rank's machine. When all ranks run on one machine and the main address is a loopback address (Lightning's
default, ``127.0.0.1``), the server is created here on a socket bound to that address (TCPStore's public
``master_listen_fd``), so nothing outside the machine can reach it. Multi-node runs keep torch's store: the other
nodes must reach it (docs/strategy.md, "What a run exposes").

A process that creates its default group again (a ``fit`` after a failed one destroyed the group) may meet the same
store again: rank 0's server lives as long as one of its stores does (the first is kept until exit), and torch's
agent store outlives the processes. torch names the new default group as it named the old one and so would read
the old group's keys (the old gloo addresses: both ranks then wait for connections that never come). Each group
therefore sees the store through a prefix of its own (:func:`group_store`), numbered by the groups this process has
created: every rank creates the same sequence of groups, as it must for their collectives to match.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["group_store", "is_loopback", "loopback_store"]

_GROUPS = itertools.count()  # the default groups this process has created
_SERVERS: dict[tuple[str, int], dist.Store] = {}  # rank 0: the first store of each address and port, kept until exit


def group_store(store: dist.Store) -> dist.Store:
    """``store`` under a prefix of its own for the next default group of this process (see the module's docstring)."""
    return dist.PrefixStore(f"lightning_mm/group{next(_GROUPS)}/", store)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a host name or an IP address) resolves to a loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta | None) -> dist.Store:
    """The TCPStore for ``rank``: its server (rank 0) listens on ``address:port`` only."""
    kwargs: dict = {"timeout": timeout} if timeout is not None else {}
    if rank != 0:
        return dist.TCPStore(address, port, world_size, False, **kwargs)
    # multi_tenant, as torch's own env:// rendezvous: a later process group of this process on the same port (after
    # a failed run, whose sharded model may still hold the old group) shares the server instead of failing to bind.
    kwargs.update(wait_for_workers=False, multi_tenant=True)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((socket.gethostbyname(address), port))
        listener.listen()
    except OSError as err:
        listener.close()
        if err.errno != errno.EADDRINUSE:
            raise
        # Our earlier server on this port, still alive in this process: TCPStore shares it (it listens on loopback).
        # If another process holds the port instead, TCPStore fails as torch's rendezvous would.
        return dist.TCPStore(address, port, world_size, True, **kwargs)
    # The store owns the descriptor from here on (detach: Python will not close it a second time). It is kept, so the
    # server stays up for a later group: a peer never meets a server that goes away under it.
    store = dist.TCPStore(address, port, world_size, True, master_listen_fd=listener.detach(), **kwargs)
    _SERVERS.setdefault((address, port), store)
    return store
