"""Writing and reading checkpoints of a sharded model: ``torch_dcp`` directories and consolidated ``torch`` files.

Every rank calls :func:`save` and :func:`load`. A ``torch_dcp`` checkpoint is a directory::

    step=100.ckpt/
        .metadata, __0_0.distcp, __1_0.distcp, ...   model and optimiser tensors (DCP, written by every rank)
        meta.pt                                      everything else (rank 0), loadable weights_only
        manifest.json                                every file's size and hashes, written last (:mod:`.manifest`)

A ``torch`` checkpoint is one file with the full (gathered) tensors in Lightning's layout, written by rank 0, its
manifest a record of its zip archive (:mod:`.zip_manifest`). Both are written next to their final path and renamed
into place when complete (:mod:`.atomic`). Every load checks every byte against the manifest first, the ranks of a
distributed load sharing the hashing and agreeing on the outcome (:func:`open_agreed`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_mm._compat import unwrap_optimizer
from lightning_mm._rank_zero import is_rank_zero, rank_zero_info, rank_zero_warn
from lightning_mm._tied import tied_parameter_names
from lightning_mm.checkpoint import atomic, digest, hf_weights, manifest, zip_manifest
from lightning_mm.checkpoint.errors import CheckpointIntegrityError, write_error
from lightning_mm.checkpoint.layout import (
    EXTRA_KEY,
    FORMAT_VERSION,
    KIND_TRAINING,
    KIND_WEIGHTS,
    META_FILE,
    SEP,
    CheckpointKeyError,
    KeyPlan,
    model_key,
    plan_keys,
    pop_loader_states,
    put_loader_states,
    split_tensors,
)
from lightning_mm.checkpoint.optim_keys import PARAM_NAMES, group_param_names, saved_names, to_index_keyed
from lightning_mm.checkpoint.records import check_records
from lightning_mm.checkpoint.safe import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_weights_only,
    load_weights_only,
    read_dcp_metadata,
)
from lightning_mm.core.grad_mode import outside_inference_mode
from lightning_mm.core.optimizer import IMPLEMENTATION_KEYS

__all__ = [
    "FORMATS",
    "model_state",
    "optimizer_state",
    "save",
    "load",
    "Loaded",
    "CheckpointSource",
    "open_source",
    "open_agreed",
    "alias_groups",
    "gather_full",
    "outside_inference_mode",
    "StateView",
    "OPTIMIZER_NAMES_KEY",
    "optimizer_param_names",
    "is_distributed",
    "broadcast_from_rank_zero",
    "gather_to_rank_zero",
    "raise_on_every_rank",
    "copy_loops",
    "write_file",
    "single_process_quiet",
]

FORMATS = ("torch_dcp", "torch")


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return unwrap_optimizer(optimizer)


# --------------------------------------------------------------------------------------- collectives
def is_distributed() -> bool:
    """Whether a process group of more than one rank is running (the collectives below are no-ops otherwise)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_from_rank_zero(obj: Any, group: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (``obj`` itself without a process group)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0, group=group)
    return box[0]


def gather_to_rank_zero(obj: Any, group: Any = None) -> list[Any] | None:
    """``obj`` of every rank, in rank order, on rank 0 (None elsewhere)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)  # all_gather: supported by every backend (gloo, nccl, hccl)
    return out if dist.get_rank() == 0 else None


def _barrier(group: Any = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def raise_on_every_rank(error: str | None) -> None:
    """Raise on every rank the error rank 0 found (so that no rank waits in a collective for the others)."""
    error = broadcast_from_rank_zero(error)
    if error:
        raise ValueError(error)


# ------------------------------------------------------------------------------------- state dicts


StateView = Callable[[dict[str, Any]], dict[str, Any]]
"""Maps a sharded state dict to the one a checkpoint stores: the same keys, some tensors replaced by views of them
with another (global) layout, sharing their storage (expert parallelism's local experts as shares of all experts)."""


def model_state(model: nn.Module, full: bool, view: StateView | None = None) -> dict[str, Any]:
    """The model state: this rank's shards, or (``full``) the gathered tensors on rank 0 and nothing elsewhere.

    With ``view``, the shards are seen through it first (and then gathered when ``full``).
    """
    if view is None:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    state = view(get_model_state_dict(model, options=StateDictOptions()))
    return gather_full(state) if full else state


def optimizer_state(model: nn.Module, optimizer: Any, full: bool, view: StateView | None = None) -> dict[str, Any]:
    """The optimiser state: this rank's shards keyed by parameter name, or (``full``) the gathered state on rank 0
    in torch's standard layout (keyed by parameter index, names kept alongside in ``param_groups``), which
    ``torch.optim.Optimizer.load_state_dict`` and other Lightning strategies load.

    With ``view``, the shards are seen through it first (and then gathered when ``full``).
    """
    if view is None:
        state = get_optimizer_state_dict(
            model, _unwrap(optimizer), options=StateDictOptions(full_state_dict=full, cpu_offload=full)
        )
    else:
        state = view(get_optimizer_state_dict(model, _unwrap(optimizer), options=StateDictOptions()))
        state = gather_full(state) if full else state
    return to_index_keyed(state) if full else state


OPTIMIZER_NAMES_KEY = "optimizer_param_names"
"""The ``lightning_mm`` entry of a ``torch`` checkpoint: each optimiser's parameter names per group, what the
indices of its (torch-layout) state stand for."""


def optimizer_param_names(model: nn.Module, optimizers: Sequence[Any]) -> list[list[list[str]]]:
    """For each optimiser, its parameter names (FQNs) per group, as :func:`optimizer_state` names them (local:
    no collective)."""
    return [
        group_param_names(get_optimizer_state_dict(model, _unwrap(o), options=StateDictOptions())) for o in optimizers
    ]


def gather_full(state: dict[str, Any]) -> dict[str, Any]:
    """Every DTensor of a (nested) state dict gathered whole, on rank 0's CPU; an empty dict on the other ranks.

    What ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` gives, for a state seen through a view. Every
    rank calls this with the same keys in the same order (one collective per DTensor).
    """
    rank0 = is_rank_zero()

    def gather(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: gather(v) for k, v in value.items()}
        if isinstance(value, list):
            return [gather(v) for v in value]
        if isinstance(value, DTensor):
            if value.device.type != value.device_mesh.device_type:  # offloaded shards: gathered on the mesh device
                value = value.to(value.device_mesh.device_type)
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            return value.detach().cpu() if rank0 else None
        return copy.deepcopy(value)

    gathered = gather(state)
    return gathered if rank0 else {}


def alias_groups(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one parameter (tied weights)."""
    return tied_parameter_names(model)


# -------------------------------------------------------------------------------------------- saving
def copy_loops(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of the dict in which the loop state may be modified (per-rank entries are taken out of it)."""
    checkpoint = dict(checkpoint)
    if "loops" in checkpoint:
        checkpoint["loops"] = copy.deepcopy(checkpoint["loops"])
    return checkpoint


def save(
    checkpoint: dict[str, Any],
    path: Path,
    fmt: str,
    extra: dict[str, Any],
    rng: dict[str, Any] | None,
    also_write: Callable[[Path], list[Path]] | None = None,
    background: Executor | None = None,
    group: Any = None,
) -> Future | None:
    """Write ``checkpoint`` (Lightning's dict) to ``path`` atomically; every rank calls this.

    ``extra`` (rank 0's) goes to ``meta[EXTRA_KEY]``; each rank's ``rng`` state and dataloader position are
    gathered into ``meta[EXTRA_KEY]["ranks"]``. ``also_write`` (``torch_dcp``; every rank calls it with the
    partial directory after the DCP files are written) writes more files into the checkpoint, e.g. Hugging Face
    weights (:mod:`.hf_weights`); the files it returns are listed in the manifest.

    With ``background`` (an executor running one task at a time), the state is staged (copied: DCP's stager, into
    pinned memory where the tensors live on an accelerator; the rest serialised) and the write, the manifest and
    the commit run there, their collectives on ``group`` (a process group of their own, so that they never
    interleave with training's); the returned future completes once the checkpoint is in place (its ``result()``
    raises what failed). Without, everything happens before this returns (None).
    """
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint_format must be one of {FORMATS}, got {fmt!r}")
    checkpoint = copy_loops(checkpoint)
    ranks = gather_to_rank_zero({"rng": rng, "combined_loader": pop_loader_states(checkpoint)})
    rank0 = ranks is not None
    error = None
    if rank0 and path.exists() and not path.is_symlink() and (path.is_dir() != (fmt == "torch_dcp")):
        kind = "directory" if path.is_dir() else "file"
        error = f"cannot write a {fmt} checkpoint to {path}: a {kind} of the other format is there"
    meta, tensors = split_tensors(checkpoint)
    meta[EXTRA_KEY] = {**extra, "format": fmt, "ranks": ranks}
    if fmt == "torch_dcp":
        meta[EXTRA_KEY]["manifest"] = manifest.MANIFEST_FILE  # a later load insists on it
    if rank0 and error is None:
        try:
            check_weights_only(meta)
        except TypeError as err:
            error = str(err)
    raise_on_every_rank(error)
    partial = Path(broadcast_from_rank_zero(str(atomic.partial_path(path))))
    if rank0:
        for stale in atomic.abandoned_partials(path.parent):  # only partials whose writer is gone, or ours
            atomic.remove(stale)
        others = atomic.live_writers(path)
        if others:
            rank_zero_warn(
                f"another run is saving {path.name} here ({'; '.join(others)}): the checkpoint "
                f"committed last replaces the other in {path.parent}"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    if fmt == "torch_dcp":
        payload: Any = meta
    else:
        payload = None
        if rank0:
            payload = dict(checkpoint)
            payload[EXTRA_KEY] = meta[EXTRA_KEY]
    if background is None:
        _write(path, partial, fmt, tensors, payload, rank0, group, also_write)
        return None
    if also_write is not None:  # it reads the live model: not safe beside training
        raise ValueError("a background save cannot also write Hugging Face weights (checkpoint_format with 'hf')")
    tensors, payload = _stage(tensors), _serialised(payload) if rank0 else None
    return background.submit(_write, path, partial, fmt, tensors, payload, rank0, group)


def _stage(tensors: dict[str, Any]) -> dict[str, Any]:
    """A copy of the tensors that training may not change meanwhile: DCP's stager, with pinned memory for tensors
    on an accelerator; plain CPU copies otherwise."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    accelerated = any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors.values())
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=accelerated,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=accelerated,
        )
    )
    try:
        # Synchronous staging (use_async_staging=False) returns the staged dict itself, never a Future.
        return cast("dict[str, Any]", stager.stage(tensors))
    finally:
        stager.close()


def _serialised(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write(
    path: Path,
    partial: Path,
    fmt: str,
    tensors: dict[str, Any],
    payload: Any,
    rank0: bool,
    group: Any,
    also_write: Callable[[Path], list[Path]] | None = None,
) -> None:
    """The write of :func:`save`: DCP shards (every rank) or the file (rank 0), the manifest, the commit."""
    failure, original, hashed = None, None, {}
    try:
        if fmt == "torch_dcp":
            writer = FileSystemWriter(partial, sync_files=True)
            writer.fs = files = manifest.RecordingFileSystem()  # each rank hashes the files it wrote
            with single_process_quiet():
                dcp.save(
                    tensors,
                    storage_writer=writer,
                    planner=DefaultSavePlanner(flatten_state_dict=False),
                    process_group=group,
                    no_dist=not is_distributed(),
                )
            hashed = manifest.file_entries(files.written)
            if also_write is not None:
                hashed.update(manifest.file_entries(also_write(partial)))
        elif rank0:
            write_file(payload, partial, with_manifest=True)
    except (Exception, CheckpointException) as error:
        failure, original = write_error(error, path), error
    results = gather_to_rank_zero((failure, hashed), group)
    if rank0:
        assert results is not None  # rank 0 holds every rank's result
        failure = next((f for f, _ in results if f is not None), None)
        if failure is None and fmt == "torch_dcp":
            try:  # the manifest comes last: it binds every file written before it to this checkpoint
                write_file(payload, partial / META_FILE)
                manifest.write_manifest(partial, [h for _, h in results], [".metadata", META_FILE])
                atomic.fsync_dir(partial)
            except Exception as error:
                failure, original = write_error(error, path), error
        if failure is not None:
            with contextlib.suppress(OSError):
                atomic.remove(partial)  # free the space now; the next save removes what is left
    failure = broadcast_from_rank_zero(failure, group)
    if failure is not None:
        raise failure from original
    if rank0:
        atomic.commit(partial, path)
    _barrier(group)


def write_file(obj: Any, path: Path, with_manifest: bool = False) -> None:
    """``torch.save`` to ``path`` (``obj`` already serialised when bytes), synced; ``with_manifest`` (a ``torch``
    format checkpoint) adds its manifest."""
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if with_manifest:
        zip_manifest.append(path)


# ------------------------------------------------------------------------------------------- sources
@dataclass
class CheckpointSource:
    """A checkpoint on disk: its meta tree and the shapes of its stored tensors, and a way to read them."""

    path: Path | str
    """The local directory or file, or the URL of a remote checkpoint (:mod:`.remote`)."""
    meta: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    is_dcp: bool
    _tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    reader: Callable[[], Any] | None = field(default=None, repr=False)
    """Makes the DCP storage reader of a checkpoint that is not a local directory (:mod:`.remote`)."""
    hf_names: dict[str, str] | None = field(default=None, repr=False)
    """The model tensors are Hugging Face safetensors: each stored key's name there (:mod:`.hf_weights`)."""

    def _storage_reader(self) -> Any:
        return self.reader() if self.reader is not None else SafeFileSystemReader(self.path)

    @property
    def extra(self) -> dict[str, Any]:
        return self.meta.get(EXTRA_KEY) or {}

    def read_into(self, destinations: Mapping[str, torch.Tensor]) -> None:
        """Fill each destination tensor (a DTensor receives its own shard) from the stored key of the same name."""
        if not destinations:
            return
        if self.hf_names is not None:
            hf_weights.read_into(self.path, destinations, self.hf_names, is_distributed())
            return
        if self.is_dcp:
            with single_process_quiet():
                dcp.load(
                    dict(destinations),
                    storage_reader=self._storage_reader(),
                    planner=SafeLoadPlanner(),
                    no_dist=not is_distributed(),
                )
            return
        assert self._tensors is not None
        for key, dest in destinations.items():
            _copy_full_into(self._tensors[key], dest)

    def read_full(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """Full CPU tensors for ``keys`` (a single process may call this)."""
        if not self.is_dcp:
            assert self._tensors is not None
            return {k: self._tensors[k] for k in keys}
        out = {k: torch.empty(self.shapes[k], dtype=self.dtypes[k]) for k in keys}
        if out and self.hf_names is not None:
            hf_weights.read_into(self.path, out, self.hf_names, distributed=False)
        elif out:
            with single_process_quiet():
                dcp.load(out, storage_reader=self._storage_reader(), planner=SafeLoadPlanner(), no_dist=True)
        return out


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _copy_full_into(full: torch.Tensor, dest: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(dest, DTensor):
            shard = distribute_tensor(full.to(dest.dtype), dest.device_mesh, dest.placements, src_data_rank=None)
            dest.to_local().copy_(shard.to_local())
        else:
            dest.copy_(full)


def open_source(path: str | Path, full_check: bool = False, share: tuple[int, int] | None = None) -> CheckpointSource:
    """Open a checkpoint written by this project (a DCP directory or a consolidated file), safely.

    Every byte is checked against the checkpoint's manifest first (:func:`.manifest.verify`,
    :func:`.zip_manifest.verify`); ``full_check`` also checks the SHA-256 of a version 1 manifest (otherwise checked
    by sample only). ``share=(rank, world_size)``: this rank hashes only its share of the files (or records), the
    others the rest; the caller must then agree with them on the outcome (:func:`open_agreed` does). (A checkpoint
    at a URL is opened by :func:`.remote.open_source`.)
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_dir():
        if not (path / META_FILE).is_file() or not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"{path} is not a complete torch_dcp checkpoint (it needs both .metadata and {META_FILE})"
            )
        hashed = None
        if share is not None:
            found = manifest.read_manifest(path)
            sizes = {name: entry["size"] for name, entry in (found or {}).get("files", {}).items()}
            hashed = digest.assign(sizes, *share, prefer=manifest.shard_rank)
        listed = manifest.verify(path, full=full_check, hashed=hashed)
        metadata = read_dcp_metadata(path)
        meta = load_weights_only(manifest.inside(path, path / META_FILE))
        _check_listed(path, listed, metadata, meta, full_check)
        shapes, dtypes = {}, {}
        for key, item in metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                shapes[key], dtypes[key] = tuple(item.size), item.properties.dtype
        record = (meta.get(EXTRA_KEY) or {}).get(hf_weights.RECORD_KEY) if isinstance(meta, dict) else None
        if record is not None and not any(k.startswith(model_key("")) for k in shapes):  # checkpoint_format="hf"
            hf_shapes, hf_dtypes, names = hf_weights.weights_view(path, record, (listed or {}).get("files"))
            return CheckpointSource(
                path, meta, {**shapes, **hf_shapes}, {**dtypes, **hf_dtypes}, is_dcp=True, hf_names=names
            )
        return CheckpointSource(path, meta, shapes, dtypes, is_dcp=True)
    zip_manifest.verify(path, digest.assign(zip_manifest.sizes(path), *share) if share is not None else None)
    full = load_weights_only(path, mmap=True)
    if not isinstance(full, dict):
        raise ValueError(f"{path}: not a Lightning checkpoint (a {type(full).__name__}, not a dict)")
    meta, tensors = split_tensors(full)
    return CheckpointSource(
        path,
        meta,
        {k: tuple(v.shape) for k, v in tensors.items()},
        {k: v.dtype for k, v in tensors.items()},
        is_dcp=False,
        _tensors=tensors,
    )


def open_agreed(path: Path | str, rank: int, world_size: int) -> CheckpointSource:
    """:func:`open_source` on every rank of a load, each hashing its share of the files: when any rank finds a
    fault, every rank raises it (the first failing rank's error), so that none goes on into a collective alone."""
    error: BaseException | None = None
    source = None
    try:
        source = open_source(path, share=(rank, world_size) if is_distributed() else None)
    except Exception as err:  # every failure is shared, whatever it is
        error = err
    if not is_distributed():
        if error is not None:
            raise error
        assert source is not None
        return source
    try:
        shared = pickle.loads(pickle.dumps(error))
    except Exception:
        shared = CheckpointIntegrityError(str(error))
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, shared)
    if error is not None:
        raise error
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    assert source is not None
    return source


def _check_listed(
    path: Path, listed: dict[str, Any] | None, metadata: Any, meta: Any, full_check: bool = False
) -> None:
    """Every file the DCP metadata reads is in the manifest; a checkpoint without one warns, unless it was written
    with one (then its manifest was removed); so does one whose manifest is checked by sample only."""
    extra = (meta.get(EXTRA_KEY) or {}) if isinstance(meta, dict) else {}
    if listed is None:
        if extra.get("manifest"):
            raise CheckpointIntegrityError(
                f"{path / manifest.MANIFEST_FILE}: missing; this checkpoint was written "
                "with a manifest, so its files cannot be trusted without it"
            )
        rank_zero_warn(
            f"{path} has no {manifest.MANIFEST_FILE} (written by an older lightning-mm): its files are "
            "not checked against one another"
        )
        return
    if manifest.sampled_only(listed) and not full_check:
        rank_zero_warn(
            f"{path}: its {manifest.MANIFEST_FILE} is of an older lightning-mm (version 1), which "
            "recorded sampled fingerprints for loads: its files are checked by sample only (256 KiB of "
            "each; `lightning-mm convert dcp-to-torch` checks their SHA-256). Save it again to have "
            "every byte checked on load"
        )
    for name in (".metadata", META_FILE, *(i.relative_path for i in (metadata.storage_data or {}).values())):
        if name not in listed["files"]:
            raise CheckpointIntegrityError(f"{path / name}: not listed in the checkpoint's {manifest.MANIFEST_FILE}")


# ------------------------------------------------------------------------------------------- loading
@dataclass
class Loaded:
    """What :func:`load` gives back: Lightning's dict for the rest of the restore, and this rank's RNG state."""

    checkpoint: dict[str, Any]
    rng: dict[str, Any] | None
    rng_point: str | None
    skipped: list[str]


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _load_model(source: CheckpointSource, model: nn.Module, strict: bool, view: StateView | None = None) -> list[str]:
    state = model_state(model, full=False)
    stored_as = view(state) if view is not None else state  # the same storage, seen as the checkpoint stores it
    prefix = model_key("")
    expected = {k: _shape(v) for k, v in stored_as.items()}
    stored = {k[len(prefix) :]: s for k, s in source.shapes.items() if k.startswith(prefix)}
    plan = plan_keys(expected, stored, alias_groups(model))
    if not plan.load and expected:
        raise CheckpointKeyError(
            f"{source.path}: no model key of the checkpoint matches the model ({plan.describe('model', 10)}); "
            "check the module prefix (e.g. `model.` of MMLightningModule)"
        )
    _check(plan, "model", source.path, strict)
    source.read_into({model_key(k): stored_as[k] for k in plan.load})
    set_model_state_dict(model, {key: state[key] for key in plan.load}, options=StateDictOptions(strict=False))
    return [*plan.missing, *plan.unexpected, *(k for k, _, _ in plan.mismatched)]


def _check(plan: KeyPlan, what: str, path: Path | str, strict: bool) -> None:
    if plan.clean:
        return
    if strict:
        raise CheckpointKeyError(
            f"{path}: the checkpoint does not match the {what} (strict loading). {plan.describe(what)}. "
            "Set `strict_loading = False` on the LightningModule to load the matching keys and skip the rest"
        )
    rank_zero_warn(f"Non-strict load of {path} skipped these {what} keys: {plan.describe(what)}")


def _saved_by_name(
    source: CheckpointSource,
    saved: Mapping[str, Any],
    current_groups: list[dict],
    prefix: str,
    where: str,
    index: int = 0,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The saved optimiser state with parameters named as today, and ``{renamed stored key: stored key}``.

    An index-keyed state (torch's layout: a checkpoint of DDP, of a single device, or this strategy's ``torch``
    format) is renamed through :func:`.optim_keys.saved_names`; a name-keyed one is unchanged. A group's
    ``param_names`` (the optimiser's own, torch's for named parameters) stay, aligned with its renamed
    ``params``; those this project's ``torch`` files once added (before :data:`OPTIMIZER_NAMES_KEY`) are dropped.
    """
    extra = source.extra
    record = extra.get(OPTIMIZER_NAMES_KEY)
    recorded = record[index] if isinstance(record, list) and index < len(record) else None
    annotated = OPTIMIZER_NAMES_KEY not in extra and extra.get("format") == "torch"
    names = saved_names(saved, current_groups, where, recorded=recorded, annotated=annotated)
    stored: dict[str, str] = {}
    for key in source.shapes:
        if key.startswith(prefix):
            pid, _, rest = key[len(prefix) :].partition(SEP)
            stored[f"{prefix}{names.get(pid, pid)}{SEP}{rest}"] = key
    state = {names.get(str(k), str(k)): v for k, v in (saved.get("state") or {}).items()}
    groups = []
    for g in saved.get("param_groups", []):
        group = {**{k: v for k, v in g.items() if k != PARAM_NAMES}, "params": [names[str(p)] for p in g["params"]]}
        if PARAM_NAMES in g and not annotated:
            group[PARAM_NAMES] = list(g[PARAM_NAMES])
        groups.append(group)
    return {"state": state, "param_groups": groups}, stored


def _load_optimizer(
    source: CheckpointSource, model: nn.Module, optimizer: Any, index: int, strict: bool, view: StateView | None = None
) -> tuple[list[str], list[int] | None]:
    """Load one optimiser's state in place; returns the skipped keys, and how its groups were regrouped
    (:func:`_merge_param_groups`)."""
    optim = _unwrap(optimizer)
    current = optimizer_state(model, optim, full=False)  # creates the state entries if the optimiser has none yet
    shown = view(current) if view is not None else current  # the same storage, seen as the checkpoint stores it
    prefix = f"optimizer_states{SEP}{index}{SEP}state{SEP}"
    saved, stored_as = _saved_by_name(
        source,
        source.meta["optimizer_states"][index],
        current["param_groups"],
        prefix,
        f"{source.path}: optimizer {index}",
        index,
    )
    # Parameters that had no optimiser state when the checkpoint was written (they never received a gradient,
    # e.g. LLaVA's unused last vision layer) are listed in the saved groups but have no saved state: they are
    # expected to have none, and get none (as in the run that wrote the checkpoint).
    stateless = {p for g in saved["param_groups"] for p in g["params"]} - set(saved["state"])
    expected: dict[str, tuple[int, ...]] = {}
    dest: dict[str, torch.Tensor] = {}
    for fqn, entries in shown["state"].items():
        if fqn in stateless:
            continue
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                key = f"{prefix}{fqn}{SEP}{name}"
                expected[key], dest[key] = _shape(value), value
    plan = plan_keys(expected, {k: source.shapes[v] for k, v in stored_as.items()})
    _check(plan, f"optimizer {index}", source.path, strict)
    source.read_into({stored_as[k]: dest[k] for k in plan.load})

    loaded = set(plan.load)
    state: dict[str, Any] = {}  # per parameter: its optimiser state (set_optimizer_state_dict's value type)
    for fqn, entries in current["state"].items():
        keys = [f"{prefix}{fqn}{SEP}{n}" for n, v in entries.items() if isinstance(v, torch.Tensor)]
        if fqn in stateless or not all(k in loaded for k in keys):
            continue  # no state in the checkpoint, or non-strict: this parameter's optimiser state starts fresh
        saved_entries = saved["state"].get(fqn, {})
        state[fqn] = {n: (v if isinstance(v, torch.Tensor) else saved_entries.get(n, v)) for n, v in entries.items()}
    groups, sources = _merge_param_groups(current["param_groups"], saved["param_groups"], source.path, index, strict)
    set_optimizer_state_dict(
        model, optim, {"state": state, "param_groups": groups}, options=StateDictOptions(strict=False)
    )  # keys were checked above
    return [*plan.missing, *plan.unexpected, *(k for k, _, _ in plan.mismatched)], sources


_NOT_HYPER = ("params", PARAM_NAMES, *IMPLEMENTATION_KEYS)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _regroup(current: list[dict], saved: list[dict]) -> list[int] | None:
    """For each current group, the saved group whose hyper-parameters it takes, when the same parameters are only
    split into groups differently (e.g. expert parallelism's whole local experts, plain tensors, are a group of
    their own, FSDP-sharded ones are not). None when the parameters differ, or when one current group would take
    parameters from saved groups with different hyper-parameters."""
    where = {name: j for j, g in enumerate(saved) for name in g.get("params", [])}
    if set(where) != {name for g in current for name in g["params"]}:
        return None
    sources = []
    for now in current:
        found = sorted({where[name] for name in now["params"]})
        hyper = [{k: v for k, v in saved[j].items() if k not in _NOT_HYPER} for j in found]
        first = hyper[0] if hyper else {}
        if any(h.keys() != first.keys() or not all(_same(h[k], first[k]) for k in h) for h in hyper):
            return None
        sources.append(found[0] if found else 0)
    return sources


def _merge_param_groups(
    current: list[dict], saved: list[dict], path: Path | str, index: int, strict: bool
) -> tuple[list[dict], list[int] | None]:
    """Saved hyper-parameters (lr, betas, ...) over the current groups, whose ``params`` name today's parameters;
    and, when the same parameters were split into groups differently (:func:`_regroup`), the saved group each
    current group comes from (None when the groups correspond one to one).

    The implementation keys (``fused``, ``foreach``) stay the current ones.
    """
    same_split = len(current) == len(saved) and all(
        sorted(now["params"]) == sorted(then.get("params", [])) for now, then in zip(current, saved)
    )
    sources = None if same_split else _regroup(current, saved)
    names = _NamesAlong(saved)
    if sources is not None:
        rank_zero_info(
            f"{path}: optimizer {index} has its parameters in {len(current)} group(s), the checkpoint in "
            f"{len(saved)} with the same hyper-parameters: each group takes its checkpointed ones"
        )
        return [
            names.along({**saved[j], "params": now["params"], **{k: now[k] for k in IMPLEMENTATION_KEYS if k in now}})
            for now, j in zip(current, sources)
        ], sources
    if len(current) != len(saved):
        message = f"{path}: optimizer {index} has {len(current)} parameter group(s), the checkpoint {len(saved)}"
        if strict:
            raise CheckpointKeyError(message)
        rank_zero_warn(f"{message}; the current groups' hyper-parameters are kept")
        return current, None
    merged = []
    for now, then in zip(current, saved):
        if strict and sorted(now["params"]) != sorted(then.get("params", [])):
            missing = sorted(set(now["params"]) - set(then.get("params", [])))
            extra = sorted(set(then.get("params", [])) - set(now["params"]))
            raise CheckpointKeyError(
                f"{path}: optimizer {index} parameter groups differ from the checkpoint's: "
                f"not in the checkpoint {missing}, only in the checkpoint {extra}"
            )
        # How a step is computed (fused/foreach) is this run's choice, not training state: the current one stays.
        implementation = {k: now[k] for k in IMPLEMENTATION_KEYS if k in now}
        merged.append(names.along({**then, "params": now["params"], **implementation}))
    return merged, None


class _NamesAlong:
    """The saved groups' own ``param_names`` (the optimiser's, torch's for named parameters), given to a merged
    group in the order of its ``params``; a merged group whose parameters they do not all name gets none (the
    optimiser then keeps its own, as torch's ``load_state_dict`` does)."""

    def __init__(self, saved: list[dict]) -> None:
        self.named = bool(saved) and all(PARAM_NAMES in g for g in saved)
        self.by_param = {p: n for g in saved for p, n in zip(g.get("params", []), g.get(PARAM_NAMES, []))}

    def along(self, group: dict) -> dict:
        group = {k: v for k, v in group.items() if k != PARAM_NAMES}
        if self.named and all(p in self.by_param for p in group["params"]):
            group[PARAM_NAMES] = [self.by_param[p] for p in group["params"]]
        return group


_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs")
"""The per-parameter-group lists in the state of torch's LR schedulers (``SequentialLR`` and ``ChainedScheduler``
keep their schedulers' states in ``_schedulers``)."""


def _remap_scheduler(state: Any, sources: list[int], saved_groups: int) -> Any:
    """A scheduler's per-group lists (``base_lrs``, ``_last_lr``, ...) in the current groups' order."""
    if not isinstance(state, dict):
        return state
    out = {}
    for key, value in state.items():
        if key in _PER_GROUP and isinstance(value, (list, tuple)) and len(value) == saved_groups:
            value = [value[j] for j in sources]
        elif key == "_schedulers" and isinstance(value, list):
            value = [_remap_scheduler(v, sources, saved_groups) for v in value]
        out[key] = value
    return out


def load(
    path: Path | str,
    model: nn.Module,
    optimizers: Sequence[Any],
    strict: bool,
    rank: int,
    world_size: int,
    fitting: bool,
    view: StateView | None = None,
    optimizer_view: StateView | None = None,
    schedulers: Sequence[Any] = (),
    source: CheckpointSource | None = None,
) -> Loaded:
    """Load model (and, when ``fitting``, optimiser) state in place; every rank calls this.

    ``view`` and ``optimizer_view`` (as in :func:`model_state` and :func:`optimizer_state`) show the model's and the
    optimisers' tensors as the checkpoint stores them: the stored tensors are read into those views, hence into
    the model's and optimisers' own storage. ``schedulers`` (Lightning's, in the order of the checkpoint's
    ``lr_schedulers``) tell which optimiser each scheduler state belongs to. ``source``, when given, is the
    checkpoint at ``path`` already opened (e.g. one at a URL: :func:`.remote.open_source`).
    """
    source = source if source is not None else open_agreed(path, rank, world_size)
    extra = source.extra
    if int(extra.get("format_version", FORMAT_VERSION)) > FORMAT_VERSION:
        raise ValueError(
            f"{path} was written by a newer lightning-mm (checkpoint format "
            f"{extra['format_version']}, this one reads up to {FORMAT_VERSION})"
        )
    kind = extra.get("kind", KIND_TRAINING)
    check_records(extra, model, str(path))  # e.g. LoRA settings that change what the adapters compute
    skipped = _load_model(source, model, strict, view)
    checkpoint = {k: v for k, v in source.meta.items() if k not in ("state_dict", "optimizer_states", EXTRA_KEY)}
    checkpoint.setdefault("state_dict", {})

    if fitting and kind == KIND_WEIGHTS:
        rank_zero_warn(
            f"{path} holds model weights only: training starts from them with a fresh optimiser, "
            "LR schedule and loop state"
        )
        for key in ("loops", "callbacks", "lr_schedulers"):
            checkpoint.pop(key, None)
        checkpoint["lr_schedulers"] = []
        return Loaded(checkpoint, None, None, skipped)
    if fitting and optimizers:
        skipped += _load_optimizers(path, source, model, optimizers, checkpoint, strict, optimizer_view, schedulers)
    rng, rng_point = _rank_state(path, extra, checkpoint, rank, world_size) if fitting else (None, None)
    return Loaded(checkpoint, rng, rng_point, skipped)


def _load_optimizers(
    path: Path | str,
    source: CheckpointSource,
    model: nn.Module,
    optimizers: Sequence[Any],
    checkpoint: dict[str, Any],
    strict: bool,
    view: StateView | None,
    schedulers: Sequence[Any],
) -> list[str]:
    """Every optimiser's state in place (regrouped by parameter name where its groups split differently, and the
    LR schedulers' per-group lists with it); returns the keys a non-strict load skipped."""
    skipped: list[str] = []
    saved = source.meta.get("optimizer_states")
    if saved is None:
        raise ValueError(
            f"{path} holds no optimizer state (saved with `save_weights_only=True`?): it cannot resume training. "
            "Use it with validate/test/predict, or convert it to a weights checkpoint"
        )
    if len(saved) != len(optimizers):
        raise ValueError(f"{path} holds state for {len(saved)} optimizer(s); the module has {len(optimizers)}")
    for i, optimizer in enumerate(optimizers):
        missed, sources = _load_optimizer(source, model, optimizer, i, strict, view)
        skipped += missed
        if sources is None:
            continue
        # Schedulers keep lists with one entry per parameter group: regrouped as the optimiser was.
        saved_groups = len(saved[i].get("param_groups", []))
        states = checkpoint.get("lr_schedulers") or []
        owners = [
            next((j for j, o in enumerate(optimizers) if _unwrap(o) is getattr(s, "optimizer", None)), None)
            for s in schedulers
        ]
        if len(owners) != len(states):
            message = (
                f"{path}: optimizer {i}'s parameter groups were regrouped, and the checkpoint's "
                f"{len(states)} LR scheduler state(s) cannot be matched to the {len(owners)} scheduler(s)"
            )
            if strict:
                raise CheckpointKeyError(message)
            rank_zero_warn(f"{message}; they are restored as saved")
            continue
        checkpoint["lr_schedulers"] = [
            _remap_scheduler(st, sources, saved_groups) if owner == i else st for st, owner in zip(states, owners)
        ]
    return skipped


def _world_size_independent(loader_states: Any) -> bool:
    """Whether every saved loader position holds for any world size (``TokenBudgetLoader``'s global position)."""
    return (
        bool(loader_states)
        and isinstance(loader_states, list)
        and all(isinstance(state, dict) and state.get("world_size_independent") is True for state in loader_states)
    )


def _rank_state(
    path: Path | str, extra: dict[str, Any], checkpoint: dict[str, Any], rank: int, world_size: int
) -> tuple[Any, Any]:
    """This rank's dataloader positions (into ``checkpoint``) and RNG state, when the world size is the same."""
    ranks = extra.get("ranks") or []
    rng = rng_point = None
    if ranks:
        if len(ranks) == world_size:
            mine = ranks[rank] or {}
            put_loader_states(checkpoint, mine.get("combined_loader"))
            rng, rng_point = mine.get("rng"), extra.get("rng_point")
        elif _world_size_independent((ranks[0] or {}).get("combined_loader")):
            put_loader_states(checkpoint, ranks[0]["combined_loader"])
            rank_zero_warn(
                f"{path} was saved on {len(ranks)} rank(s) and is loaded on {world_size}: model and optimizer state "
                "are resharded and the token-budget loader continues with the next unseen batch of the epoch; the "
                "per-rank RNG states are not restored"
            )
        else:
            rank_zero_warn(
                f"{path} was saved on {len(ranks)} rank(s) and is loaded on {world_size}: model and optimizer state "
                "are resharded; the per-rank dataloader positions and RNG states are not restored (the current "
                "epoch's data restarts from its beginning)"
            )
    return rng, rng_point
