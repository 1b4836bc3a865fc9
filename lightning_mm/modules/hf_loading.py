"""Doing the loading of a :class:`~lightning_mm.modules.hf_checkpoint.LoadPlan`.

* :func:`load_local_shards` fills a sharded model in place: for a DTensor parameter each rank reads only the
  slice of the safetensors tensor that its local shard covers (``safe_open(...).get_slice``, memory-mapped), so
  no rank ever holds the full model and nothing is broadcast. Unsharded tensors (ignored modules, buffers) are
  read whole.
* :func:`load_into_meta_model` gives an unsharded model built with meta-device parameters its real parameters,
  straight from the files (no random init, no second copy).

Values are converted to the dtype of the model's tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mm.modules.hf_checkpoint import CheckpointError, LoadEntry, LoadPlan, TensorInfo

__all__ = ["load_local_shards", "load_into_meta_model", "local_region"]

log = logging.getLogger(__name__)


@contextmanager
def _open_files(plan: LoadPlan) -> Iterator[dict[str, Any]]:
    from safetensors import safe_open

    with ExitStack() as stack:
        yield {
            name: stack.enter_context(safe_open(str(Path(plan.directory) / name), framework="pt"))
            for name in plan.files
        }


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the part of the global tensor this rank holds (all of it for a plain tensor)."""
    if isinstance(tensor, DTensor):
        chunks = tensor.__create_chunk_list__()
        if len(chunks) != 1:
            raise NotImplementedError(f"a DTensor with {len(chunks)} local chunks cannot be loaded by slices")
        return tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return (0,) * tensor.ndim, tuple(tensor.shape)


def _read(files: dict[str, Any], info: TensorInfo, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    handle = files[info.file]
    if not sizes:  # a scalar
        return handle.get_tensor(info.key)
    if tuple(sizes) == info.shape:
        return handle.get_tensor(info.key)
    region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
    return handle.get_slice(info.key)[region]


def _fill(files: dict[str, Any], entry: LoadEntry, tensor: torch.Tensor) -> None:
    offsets, sizes = local_region(tensor)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if tuple(local.shape) != tuple(sizes):
        raise RuntimeError(f"{entry.names[0]}: local shard is {list(local.shape)}, expected {list(sizes)}")
    if local.numel() == 0:
        return
    data = _read(files, entry.source, offsets, sizes)
    for duplicate in entry.duplicates:  # a tied weight stored twice: both copies must agree
        if not torch.equal(_read(files, duplicate, offsets, sizes), data):
            raise CheckpointError(
                f"{entry.names} are one tied weight, but checkpoint tensors '{entry.source.key}' and "
                f"'{duplicate.key}' differ; set tie_word_embeddings=False in the config to keep them apart"
            )
    with torch.no_grad():
        local.copy_(data.to(device=local.device, dtype=local.dtype))


def load_local_shards(model: nn.Module, plan: LoadPlan) -> int:
    """Fill every tensor of ``plan`` in ``model`` in place, reading only this rank's shards. Returns the count."""
    state = model.state_dict(keep_vars=True)
    absent = [e.names[0] for e in plan.entries if e.names[0] not in state]
    if absent:
        raise RuntimeError(f"the model no longer has tensors the load plan was made for: {absent[:10]}")
    with _open_files(plan) as files:
        for entry in plan.entries:
            _fill(files, entry, state[entry.names[0]])
    return len(plan.entries)


def _set_parameter(model: nn.Module, names: tuple[str, ...], param: nn.Parameter) -> None:
    for name in names:
        parent, _, leaf = name.rpartition(".")
        module = model.get_submodule(parent) if parent else model
        module._parameters[leaf] = param


def load_into_meta_model(model: nn.Module, plan: LoadPlan, device: torch.device | str = "cpu") -> None:
    """Replace ``model``'s meta-device parameters by the checkpoint's tensors (tied names share one parameter).

    Real parameters and persistent buffers are filled in place. Any parameter left on the meta device afterwards
    is an error naming it.
    """
    state = model.state_dict(keep_vars=True)
    with _open_files(plan) as files:
        for entry in plan.entries:
            current = state[entry.names[0]]
            if not current.is_meta:
                _fill(files, entry, current)
                continue
            data = files[entry.source.file].get_tensor(entry.source.key)
            for duplicate in entry.duplicates:
                if not torch.equal(files[duplicate.file].get_tensor(duplicate.key), data):
                    raise CheckpointError(
                        f"{entry.names} are one tied weight, but checkpoint tensors '{entry.source.key}' and "
                        f"'{duplicate.key}' differ; set tie_word_embeddings=False in the config to keep them apart"
                    )
            value = data.to(device=device, dtype=current.dtype)
            _set_parameter(model, entry.names, nn.Parameter(value, requires_grad=current.requires_grad))
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"parameters left on the meta device after loading {plan.directory}: {left[:10]}")
