"""Refuse, before anything is allocated, a sharded model whose parameters this rank's device cannot hold.

The model is still on the meta device when the strategy applies its plan: :func:`check_parameters_fit` sums the
bytes of this rank's parameter shards (:func:`~lightning_mm.core.memory.per_rank_memory`, what ``lightning-mm plan``
prints) and compares them with the memory free where the parameters will live: the accelerator's free memory
(``torch.<device type>.mem_get_info``), or the host's available memory (``MemAvailable`` in ``/proc/meminfo``) for
CPU runs and ``offload_to_cpu``. Only the parameters are counted, which every stage allocates: a refusal is never
wrong, and a run that passes may still need more (gradients, optimiser state, activations; the message gives the
figures). Where free memory cannot be read, or the model was built with real parameters (they exist already),
nothing is checked.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from lightning_mm.core.memory import per_rank_memory
from lightning_mm.core.sharding_plan import ShardingPlan
from lightning_mm.errors import LightningMMError

__all__ = ["ModelTooLargeError", "available_bytes", "check_parameters_fit"]


class ModelTooLargeError(LightningMMError, MemoryError):
    """The parameters of one rank's shards are more than the memory free where they would be materialised."""


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (the host's available memory for ``cpu``), or ``None`` where it cannot be read."""
    if device.type == "cpu":
        return _host_available()
    try:
        module = torch.get_device_module(device.type)
        free, _ = module.mem_get_info(device)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return int(free)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB ({n:,} B)"


def check_parameters_fit(model: nn.Module, plan: ShardingPlan, device: torch.device) -> None:
    """Raise :class:`ModelTooLargeError` when this rank's parameter shards of ``model`` under ``plan`` exceed the
    free memory of the device they go to (``device``, or the CPU with ``offload_to_cpu``)."""
    if not any(p.is_meta for p in model.parameters()):
        return  # built with real parameters (empty_init=False): allocated already, by choice
    where = torch.device("cpu") if plan.offload_to_cpu else device
    memory = per_rank_memory(model, plan)
    available = available_bytes(where)
    if available is None or memory.params <= available:
        return
    raise ModelTooLargeError(
        f"the model does not fit: each rank's parameter shards need {_gib(memory.params)} on {where} (sharded over "
        f"{plan.sharding_size} rank(s); with gradients and Adam states {_gib(memory.total)}), and {_gib(available)} "
        "is free there. Shard over more ranks, offload parameters to the CPU (offload_to_cpu), or use a smaller "
        "model; `lightning-mm plan` prints the per-rank figures"
    )
