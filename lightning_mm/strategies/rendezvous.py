"""The rendezvous store of a single-node run, listening on the loopback interface only.

``torch.distributed.init_process_group("env://")`` starts a TCPStore server that listens on every interface of the
launching rank's machine. When all ranks run on one machine and the main address is a loopback address (Lightning's
default, ``127.0.0.1``), the server is created here on a socket bound to that address (TCPStore's public
``master_listen_fd``), so nothing outside the machine can reach it. Multi-node runs keep torch's store: the other
nodes must reach it (docs/strategy.md, "What a run exposes").
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["is_loopback", "loopback_store"]


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
    # The store owns the descriptor from here on (detach: Python will not close it a second time).
    return dist.TCPStore(address, port, world_size, True, master_listen_fd=listener.detach(), **kwargs)
