"""Sharded checkpoints with torch.distributed.checkpoint (the seed's ``--ckpt-format torch_dcp``).

A checkpoint is a directory: model and optimiser shards written in parallel by every rank, plus ``meta.pt`` with
the rest of Lightning's checkpoint (loops, schedulers, callbacks), written by rank 0 and loaded ``weights_only``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["sharded_model_state", "sharded_optimizer_state", "save_dcp", "load_dcp", "remove", "META_FILE"]

META_FILE = "meta.pt"
_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)


def sharded_model_state(model: nn.Module) -> dict[str, Any]:
    """This rank's shards of the model state (DTensors)."""
    return get_model_state_dict(model, options=_SHARDED)


def sharded_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's shards of the optimiser state, keyed by parameter names."""
    return get_optimizer_state_dict(model, _unwrap(optimizer), options=_SHARDED)


def save_dcp(checkpoint: dict[str, Any], path: Path, is_global_zero: bool) -> None:
    """Write Lightning's checkpoint dict as a DCP directory (every rank must call this)."""
    if path.is_file():
        raise FileExistsError(f"checkpoint path exists and is a file: {path}")
    path.mkdir(parents=True, exist_ok=True)
    checkpoint = dict(checkpoint)
    state = {"model": checkpoint.pop("state_dict")}
    for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optim_state
    dcp.save(state, checkpoint_id=path)
    if is_global_zero:
        torch.save(checkpoint, path / META_FILE)


def load_dcp(path: Path, model: nn.Module, optimizers: list[Any], strict: bool = True) -> dict[str, Any]:
    """Load model and optimiser shards in place from a DCP directory; return the rest of the checkpoint."""
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"not a DCP checkpoint directory (no .metadata): {path}")
    state: dict[str, Any] = {"model": sharded_model_state(model)}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = sharded_optimizer_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, _unwrap(optimizer), state[f"optimizer_{i}"], options=_SHARDED)
    return torch.load(path / META_FILE, weights_only=True)


def remove(path: Path) -> None:
    """Delete a checkpoint written by :func:`save_dcp` (a directory) or a single file."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
