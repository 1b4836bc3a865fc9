"""Model weights as Hugging Face safetensors inside a checkpoint directory (``checkpoint_format="hf"`` and
``"torch_dcp+hf"`` of :class:`~lightning_mm.MMFSDP2Strategy`).

Written with DCP's Hugging Face storage (``HuggingFaceStorageWriter``): every rank writes its own shards to
``<checkpoint>/sharded/``, rank 0 consolidates them into ``model-00001-of-00001.safetensors`` and
``model.safetensors.index.json`` at the top of the checkpoint directory (then drops ``sharded/``), so that the
directory loads with ``transformers``' ``from_pretrained`` when the layer above adds ``config.json``. The tensors'
names are the ones given (``save_pretrained``'s names for a Transformers model, chosen by
:mod:`lightning_mm.hf.checkpoint_format`); the checkpoint's meta records which model tensor each one is
(``meta[EXTRA_KEY]["hf_weights"]``), and the manifest lists every file, so a load checks them as the others.

This module knows no Transformers: only safetensors files and a name map.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError, CheckpointMismatchError
from lightning_mm.checkpoint.checkpoint_layout import model_key
from lightning_mm.errors import ConfigError

__all__ = ["RECORD_KEY", "DTYPES", "SHARDED_DIR", "INDEX_FILE", "check_dtype", "write", "weights_view", "read_into"]

RECORD_KEY = "hf_weights"
"""``meta[EXTRA_KEY][RECORD_KEY]``: ``{"keys": {model FQN: safetensors name}, "dtype": str | None}``."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHARDED_DIR = "sharded"
INDEX_FILE = "model.safetensors.index.json"


def check_dtype(save_ckpt_dtype: str | None) -> torch.dtype | None:
    """The dtype of ``save_ckpt_dtype`` (``fp32``, ``fp16``, ``bf16``; None keeps the model's)."""
    if save_ckpt_dtype is None:
        return None
    if save_ckpt_dtype not in DTYPES:
        raise ConfigError(f"save_ckpt_dtype must be one of {sorted(DTYPES)} or None, got {save_ckpt_dtype!r}")
    return DTYPES[save_ckpt_dtype]


def write(
    state: Mapping[str, torch.Tensor],
    directory: Path,
    keys: Mapping[str, str],
    dtype: torch.dtype | None,
    distributed: bool,
) -> list[Path]:
    """Write the model tensors ``state`` (this rank's shards, by FQN) under their names ``keys`` into
    ``directory`` (every rank calls this); returns the files left in ``directory`` (on rank 0; the others wrote
    only shards, consolidated and removed)."""
    missing = sorted(set(keys) - set(state))
    if missing:
        raise CheckpointMismatchError(
            f"the Hugging Face weights name {len(missing)} tensor(s) the model state lacks: {missing[:5]}"
        )
    tensors = {}
    for fqn, name in keys.items():
        tensor = state[fqn]
        tensors[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    writer = HuggingFaceStorageWriter(
        str(directory), save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=dict.fromkeys(tensors, 1)
    )
    dcp.save(
        tensors, storage_writer=writer, planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=not distributed
    )
    if distributed and torch.distributed.get_rank() != 0:
        return []  # rank 0 consolidated every rank's shards (DCP's finish step) and lists the files
    sharded = directory / SHARDED_DIR
    if sharded.is_dir():
        shutil.rmtree(sharded)  # consolidated: the per-rank shards are not part of the checkpoint
    return sorted(p for p in directory.iterdir() if p.suffix == ".safetensors" or p.name == INDEX_FILE)


def weights_view(
    path: Path, record: Any, listed: Mapping[str, Any] | None
) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype], dict[str, str]]:
    """Shapes and dtypes of the stored model tensors under their checkpoint keys (``state_dict/<fqn>``), and each
    key's safetensors name; the files read must be listed in the checkpoint's manifest (``listed``)."""
    if not isinstance(record, Mapping) or not isinstance(record.get("keys"), Mapping):
        raise CheckpointIntegrityError(f"{path}: malformed {RECORD_KEY} record in its meta")
    names: dict[str, str] = {model_key(str(k)): str(v) for k, v in record["keys"].items()}
    files = sorted(p.name for p in path.iterdir() if p.suffix == ".safetensors")
    if listed is not None:
        unlisted = [f for f in files if f not in listed]
        if unlisted:
            raise CheckpointIntegrityError(
                f"{path / unlisted[0]}: not part of this checkpoint (its manifest does not list it)"
            )
    metadata = HuggingFaceStorageReader(str(path)).read_metadata()
    stored = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    absent = sorted(n for n in names.values() if n not in stored)
    if absent:
        raise CheckpointIntegrityError(
            f"{path}: its safetensors files lack {len(absent)} tensor(s) its meta lists, e.g. {absent[:3]}"
        )
    shapes = {key: tuple(stored[name].size) for key, name in names.items()}
    dtypes = {key: stored[name].properties.dtype for key, name in names.items()}
    return shapes, dtypes, names


def read_into(
    path: Path | str, destinations: Mapping[str, torch.Tensor], names: Mapping[str, str], distributed: bool
) -> None:
    """Fill each destination (by checkpoint key; a DTensor receives its own shard) from the safetensors files."""
    renamed = {names[key]: tensor for key, tensor in destinations.items()}
    dcp.load(
        renamed,
        storage_reader=HuggingFaceStorageReader(str(path)),
        planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        no_dist=not distributed,
    )
