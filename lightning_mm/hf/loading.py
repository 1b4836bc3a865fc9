"""Doing the loading of a :class:`~lightning_mm.hf.pretrained_index.LoadPlan`.

* :func:`load_local_shards` fills a sharded model in place: for a DTensor parameter each rank reads only the
  bytes of the region its local shard covers (FSDP2 shards rows, which are contiguous in a safetensors file), so
  no rank ever holds the full model and nothing is broadcast. Unsharded tensors (ignored modules, buffers) are
  read whole.
* :func:`load_into_meta_model` gives an unsharded model built with meta-device parameters its real parameters,
  straight from the files (no random init, no second copy).

Reads are plain file reads into the destination tensor's own memory (when the dtype matches) rather than a
memory map: pages of a mapped file count toward the resident memory of every process that touches them. Other
regions (not whole rows) go through ``safetensors.safe_open(...).get_slice``. Values are converted to the dtype of
the model's tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from io import BufferedReader
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mm._compat import local_offsets
from lightning_mm._utils.distributed import local_tensor
from lightning_mm._utils.safetensors_index import DTYPES
from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError, CheckpointMismatchError
from lightning_mm.errors import StateError
from lightning_mm.hf.pretrained_index import LoadEntry, LoadPlan, TensorInfo

__all__ = ["load_local_shards", "load_into_meta_model", "local_region", "read_region"]

log = logging.getLogger(__name__)


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the part of the global tensor this rank holds (all of it for a plain tensor)."""
    if isinstance(tensor, DTensor):
        return local_offsets(tensor)
    return (0,) * tensor.ndim, tuple(tensor.shape)


def _readinto(f: BufferedReader, start: int, out: torch.Tensor) -> None:
    view = out.reshape(-1).view(torch.uint8).numpy().data  # the tensor's bytes, as a memoryview
    f.seek(start)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointIntegrityError(f"{getattr(f, 'name', 'file')}: unexpected end of file")
        done += n


def read_region(
    directory: str | Path,
    files: dict[str, BufferedReader],
    info: TensorInfo,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """Fill ``out`` (shape ``sizes``) with the region ``offsets``/``sizes`` of the checkpoint tensor ``info``."""
    dtype = DTYPES.get(info.dtype)
    rows = all(o == 0 for o in offsets[1:]) and tuple(sizes[1:]) == info.shape[1:]
    if dtype is None or not rows:
        from safetensors import safe_open

        with safe_open(str(Path(directory) / info.file), framework="pt") as handle:
            region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            data = handle.get_slice(info.key)[region] if sizes else handle.get_tensor(info.key)
        out.copy_(data)
        return
    row_bytes = dtype.itemsize
    for d in info.shape[1:]:
        row_bytes *= d
    start = info.start + (offsets[0] if offsets else 0) * row_bytes
    direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
    target = out if direct else torch.empty(sizes, dtype=dtype)
    _readinto(files[info.file], start, target)
    if not direct:
        out.copy_(target)


@contextmanager
def _open_files(plan: LoadPlan) -> Iterator[dict[str, BufferedReader]]:
    with ExitStack() as stack:
        yield {name: stack.enter_context(open(Path(plan.directory) / name, "rb")) for name in plan.files}


def _fill(
    plan: LoadPlan, files: dict[str, BufferedReader], entry: LoadEntry, tensor: torch.Tensor, first_row: int = 0
) -> None:
    offsets, sizes = local_region(tensor)
    if first_row:  # the local experts of an expert-parallel module: rows from `first_row` on
        offsets = (offsets[0] + first_row, *offsets[1:])
    local = local_tensor(tensor)
    if tuple(local.shape) != tuple(sizes):
        raise RuntimeError(f"{entry.names[0]}: local shard is {list(local.shape)}, expected {list(sizes)}")
    if local.numel() == 0:
        return
    with torch.no_grad():
        if entry.stacked is not None:  # stored one piece per expert: read the held experts' pieces (their rows)
            _fill_stacked(plan, files, entry.stacked, offsets, sizes, local)
            return
        if entry.transpose is not None:  # stored with two (non-leading) dimensions swapped
            d0, d1 = entry.transpose
            src_offsets, src_sizes = list(offsets), list(sizes)
            src_offsets[d0], src_offsets[d1] = src_offsets[d1], src_offsets[d0]
            src_sizes[d0], src_sizes[d1] = src_sizes[d1], src_sizes[d0]
            stored = torch.empty(src_sizes, dtype=local.dtype)
            read_region(plan.directory, files, entry.source, tuple(src_offsets), tuple(src_sizes), stored)
            local.copy_(stored.transpose(d0, d1))
            return
        read_region(plan.directory, files, entry.source, offsets, sizes, local)
        for duplicate in entry.duplicates:  # a tied weight stored twice: both copies must agree
            other = torch.empty_like(local)
            read_region(plan.directory, files, duplicate, offsets, sizes, other)
            if not torch.equal(other, local):
                raise CheckpointMismatchError(
                    f"{entry.names} are one tied weight, but checkpoint tensors '{entry.source.key}' and "
                    f"'{duplicate.key}' differ; set tie_word_embeddings=False in the config to keep them apart"
                )


def _fill_stacked(
    plan: LoadPlan,
    files: dict[str, BufferedReader],
    stacked: tuple[tuple[TensorInfo, ...], ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    local: torch.Tensor,
) -> None:
    """The region ``offsets``/``sizes`` of a 3-D experts tensor stored as 2-D pieces: for each expert in the region,
    the rows of its pieces (in row order) that fall inside it."""
    first_row, rows = offsets[1], sizes[1]
    for j in range(sizes[0]):
        start = 0
        for piece in stacked[offsets[0] + j]:
            end = start + piece.shape[0]
            a, b = max(start, first_row), min(end, first_row + rows)
            if a < b:
                out = local[j, a - first_row : b - first_row]
                read_region(plan.directory, files, piece, (a - start, offsets[2]), (b - a, sizes[2]), out)
            start = end


def load_local_shards(model: nn.Module, plan: LoadPlan) -> int:
    """Fill every tensor of ``plan`` in ``model`` in place, reading only this rank's shards. Returns the count."""
    state = model.state_dict(keep_vars=True)
    absent = [e.names[0] for e in plan.entries if e.names[0] not in state]
    if absent:
        raise StateError(f"the model no longer has tensors the load plan was made for: {absent[:10]}")
    from lightning_mm.core.expert_parallel import expert_row_offset

    with _open_files(plan) as files:
        for entry in plan.entries:
            parent = entry.names[0].rpartition(".")[0]
            first_row = expert_row_offset(model.get_submodule(parent)) if parent else 0
            _fill(plan, files, entry, state[entry.names[0]], first_row)
    return len(plan.entries)


def _set_parameter(model: nn.Module, names: tuple[str, ...], param: nn.Parameter) -> None:
    for name in names:
        parent, _, leaf = name.rpartition(".")
        module = model.get_submodule(parent) if parent else model
        module.register_parameter(leaf, param)


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
                _fill(plan, files, entry, current)
                continue
            if not entry.is_parameter:
                raise CheckpointMismatchError(
                    f"buffer {entry.names[0]} is on the meta device and cannot be filled in place"
                )
            value = torch.empty(current.shape, dtype=current.dtype, device="cpu")
            _fill(plan, files, entry, value)
            param = nn.Parameter(value.to(device), requires_grad=current.requires_grad)
            _set_parameter(model, entry.names, param)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointMismatchError(f"parameters left on the meta device after loading {plan.directory}: {left[:10]}")
