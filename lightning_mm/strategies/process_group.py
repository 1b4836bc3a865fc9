"""The strategy's process group: created once per process, destroyed after a failed run and at interpreter exit.

:class:`ProcessGroupOwner` starts the default group (a loopback-only rendezvous store for a single-node run that
Lightning launched; torchrun's agent owns the store of the runs it starts), remembers whether it created it, and
destroys it only when it did: after a failed run (peers blocked in a collective then fail instead of waiting for the
timeout, and a later Trainer in this process starts a fresh group) and at interpreter exit. After a successful
run the group stays, because the sharded model is bound to it.
"""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mm.core.backend import process_group_backend
from lightning_mm.strategies.rendezvous import is_loopback, loopback_store

__all__ = ["ProcessGroupOwner", "destroy_process_group", "drain_gloo_workers"]

log = logging.getLogger(__name__)


def destroy_process_group() -> None:
    """Destroy the default process group, if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def drain_gloo_workers() -> None:
    """Barrier on the default gloo group, so that its worker threads release their finished collectives now.

    A gloo worker thread drops its reference to a collective it has run just after the caller's ``wait()`` has
    returned. When that reference is the last one and the work holds a Python object (a collective issued during
    backward keeps the ``contextvars`` context that backward stashes in thread-local state), the release needs the
    GIL; a thread that asks for it once the interpreter is finalizing is ended by ``pthread_exit`` inside a
    ``noexcept`` destructor: ``terminate called without an active exception``, SIGABRT, after a successful run.
    Queuing the barrier takes the workers' queue lock and waiting for it lets go of the GIL, so a pending release
    finishes here, while the interpreter is still whole; the barrier's own work holds no Python object.

    The exit of each rank therefore waits until every rank has finished (up to the process-group timeout for a
    peer that hangs): destroying a gloo group waits for its queued work anyway, so a shorter bound would not help.
    """
    if dist.get_backend() != "gloo":
        return
    try:
        dist.barrier()
    except RuntimeError as err:  # a peer already gone: nothing left to wait for, destroy the group anyway
        log.debug("MMFSDP2Strategy: barrier before destroying the process group at exit failed: %s", err)


def _destroy_at_exit() -> None:
    """The ``atexit`` handler: let the gloo workers go idle, then destroy the process group."""
    if dist.is_available() and dist.is_initialized():
        drain_gloo_workers()
    destroy_process_group()


class ProcessGroupOwner:
    """Creates the default process group for a strategy (when none exists) and destroys what it created."""

    def __init__(self, timeout: timedelta | None, backend: str | None = None) -> None:
        self.timeout = timeout
        self.backend = backend
        """The backend given, or the one :meth:`start` chose from the device (``None`` before)."""
        self.created = False
        """Whether this owner created the default process group (and so may destroy it)."""

    def start(
        self,
        env: ClusterEnvironment,
        global_rank: int,
        world_size: int,
        device: torch.device,
        num_nodes: int,
        offload_to_cpu: bool,
    ) -> None:
        """Initialise the default process group unless one exists; ``device`` is this rank's device. Without a
        given backend, the device's (``cpu:gloo`` mixed in when ``offload_to_cpu``)."""
        if self.backend is None:
            self.backend = process_group_backend(device, offload_to_cpu)
        if dist.is_initialized():
            return
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        kwargs: dict[str, object] = {"timeout": self.timeout}
        if device.type != "cpu":
            kwargs["device_id"] = device
        if type(env) is LightningEnvironment and num_nodes == 1 and is_loopback(env.main_address):
            # A single-node run started by Lightning: the rendezvous store listens on the loopback interface only.
            kwargs["store"] = loopback_store(env.main_address, env.main_port, global_rank, world_size, self.timeout)
        dist.init_process_group(self.backend, rank=global_rank, world_size=world_size, **kwargs)  # type: ignore[arg-type]
        self.created = True
        atexit.unregister(_destroy_at_exit)
        atexit.register(_destroy_at_exit)
        rank_zero_info(f"MMFSDP2Strategy: {world_size} processes, backend {self.backend}")

    def barrier(self, device: torch.device) -> None:
        """A barrier on the default group, on this rank's own ``device`` for nccl, hccl, xccl... (none outside a
        process group)."""
        if not dist.is_initialized():
            return
        if device.type != "cpu":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank (pickled; ``obj`` itself outside a process group)."""
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def end_failed_run(self) -> None:
        """After a failed run: destroy the group this owner created (the communicators are freed now)."""
        if self.created:
            destroy_process_group()
            self.created = False
