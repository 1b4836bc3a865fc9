"""The strategy's process group: created when a run needs one, destroyed after a failed run and at interpreter exit.

:class:`ProcessGroupOwner` starts the default group when there is none (a loopback-only rendezvous store for a
single-node run that Lightning launched; torchrun's agent owns the store of the runs it starts). A group that a
strategy of this process created is destroyed after any failed run on it, whichever Trainer created it (a peer may
have been left in a collective: the group cannot be trusted again; peers blocked in a collective then fail instead
of waiting for the timeout, and a later Trainer in this process starts a fresh group), and at interpreter exit. A
group the user created is never destroyed. After a successful run the group stays, because the sharded model is
bound to it, and a later Trainer of this process uses it too.

A ``fit`` after a failed one creates a new group (its keys in the rendezvous store are its own:
:func:`~lightning_mm.strategies.rendezvous.group_store`). Destroying a group does not close its gloo connections
while Python still holds it (the failed run's sharded model does): a peer rank still blocked in a collective of the
failed run (the run failed on this rank only) is released only when the group is freed, and would otherwise wait for
the process-group timeout while this rank waits for it in the new group's rendezvous. So before it creates a new
group, :meth:`ProcessGroupOwner.start` collects the garbage (the failed run's model and Trainer are usually cycles
nobody holds any more) and warns, on the ranks concerned, when a destroyed group is still held.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import warnings
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mm._compat import clear_sharding_prop_cache
from lightning_mm.core.backend import process_group_backend
from lightning_mm.strategies.rendezvous import group_store, is_loopback, loopback_store

__all__ = ["ProcessGroupOwner", "created_here", "destroy_process_group", "drain_gloo_workers", "release_ended_groups"]

log = logging.getLogger(__name__)
_ENDED: list[weakref.ref] = []  # the groups destroyed after a failed run, until they are freed
_CREATED: list[weakref.ref] = []  # the default group that a strategy of this process created, while it lives


def created_here() -> bool:
    """Whether the default group is one that a strategy of this process created (and so may destroy)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return any(ref() is dist.group.WORLD for ref in _CREATED)


def release_ended_groups(timeout: timedelta | None) -> None:
    """Free the groups destroyed after failed runs of this process (their gloo connections close, so a peer blocked
    in a collective with this rank fails now); warn when one is still held (see the module's docstring)."""
    if not _ENDED:
        return
    clear_sharding_prop_cache()  # its cached meshes hold their groups
    gc.collect()
    _ENDED[:] = [ref for ref in _ENDED if ref() is not None]
    if _ENDED:
        _ENDED.clear()  # warned once; the next failed run's group is watched afresh
        warnings.warn(
            "MMFSDP2Strategy: the process group of an earlier failed run is still referenced on this rank (by that "
            "run's model or Trainer, say), so its connections stay open: a rank still blocked in a collective of "
            f"that run joins this one only after the process-group timeout ({timeout}). Delete the failed run's "
            "model and Trainer before fitting again.",
            stacklevel=2,
        )


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
    """Creates the default process group for a strategy (when none exists); destroys it after a failed run when a
    strategy of this process created it."""

    def __init__(self, timeout: timedelta | None, backend: str | None = None) -> None:
        self.timeout = timeout
        self.backend = backend
        """The backend given, or the one :meth:`start` chose from the device (``None`` before)."""

    @property
    def created(self) -> bool:
        """Whether the default process group is one that a strategy of this process created (this owner or an
        earlier Trainer's), and so may be destroyed after a failed run."""
        return created_here()

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
        release_ended_groups(self.timeout)
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        kwargs: dict[str, object] = {"timeout": self.timeout}
        if device.type != "cpu":
            kwargs["device_id"] = device
        if type(env) is LightningEnvironment and num_nodes == 1 and is_loopback(env.main_address):
            # A single-node run started by Lightning: the rendezvous store listens on the loopback interface only.
            store = loopback_store(env.main_address, env.main_port, global_rank, world_size, self.timeout)
        else:  # torch's env:// rendezvous, as init_process_group's own
            rendezvous_kwargs = {"timeout": self.timeout} if self.timeout is not None else {}
            store, _, _ = next(dist.rendezvous("env://", global_rank, world_size, **rendezvous_kwargs))
        kwargs["store"] = group_store(store)  # keys of its own, never an earlier group's (rendezvous.group_store)
        dist.init_process_group(self.backend, rank=global_rank, world_size=world_size, **kwargs)  # type: ignore[arg-type]
        _CREATED[:] = [weakref.ref(dist.group.WORLD)]
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
        """After a failed run: destroy the default group if a strategy of this process created it (a peer may be
        left in a collective of it); it is freed before the next group is created (:func:`release_ended_groups`)."""
        if created_here():
            _ENDED.append(weakref.ref(dist.group.WORLD))
            _CREATED.clear()
            destroy_process_group()
