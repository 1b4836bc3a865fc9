"""A diffusers ``save_pretrained`` directory's weights: its safetensors layout, and the strict load plan.

diffusers writes ``diffusion_pytorch_model.safetensors``, or shards listed in
``diffusion_pytorch_model.safetensors.index.json``; keys are the model's own state-dict names (no renaming). The
plan is the project's :class:`~lightning_mm.hf.pretrained_index.LoadPlan`, read by the same sliced loading as a
Transformers model (:mod:`lightning_mm.hf.loading`: each rank reads only the rows of its shards).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from torch import nn

from lightning_mm._compat import keys_to_ignore_on_load_unexpected
from lightning_mm._utils.modules import names_by_tensor
from lightning_mm.checkpoint.checkpoint_errors import CheckpointMismatchError
from lightning_mm.hf.pretrained_index import (
    LoadEntry,
    LoadPlan,
    SafetensorsIndex,
    TensorInfo,
    strict_load_problems,
)

__all__ = ["WEIGHTS_NAME", "WEIGHTS_INDEX_NAME", "read_diffusers_weights", "diffusers_load_plan"]

log = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


def read_diffusers_weights(directory: str | Path) -> SafetensorsIndex:
    """The tensors of a diffusers model directory, from the safetensors headers (nothing else is read)."""
    return SafetensorsIndex.from_directory(directory, WEIGHTS_NAME, "diffusers' safetensors weights")


def diffusers_load_plan(model: nn.Module, index: SafetensorsIndex) -> LoadPlan:
    """Match every checkpoint tensor to ``model``'s state dict by name, strictly: missing, unexpected (except the
    keys the class declares ignorable, ``_keys_to_ignore_on_load_unexpected``) and misshapen tensors are one
    error listing them all."""
    state = model.state_dict(keep_vars=True)
    params = {id(p) for p in model.parameters()}
    groups = names_by_tensor(state.items())
    owner = {name: key for key, names in groups.items() for name in names}
    ignorable = [re.compile(p) for p in keys_to_ignore_on_load_unexpected(model)]
    found: dict[int, list[TensorInfo]] = {}
    unexpected: list[str] = []
    ignored: list[str] = []
    misshapen: list[str] = []
    for key, info in sorted(index.tensors.items()):
        if key not in owner:
            (ignored if any(p.search(key) for p in ignorable) else unexpected).append(key)
            continue
        if tuple(info.shape) != tuple(state[key].shape):
            misshapen.append(f"{key}: checkpoint {list(info.shape)}, model {list(state[key].shape)}")
            continue
        found.setdefault(owner[key], []).append(info)
    entries: list[LoadEntry] = []
    missing: list[str] = []
    buffers_kept: list[str] = []
    for tensor_id, names in groups.items():
        sources = found.get(tensor_id)
        if not sources:
            if not any(n in {m.split(":")[0] for m in misshapen} for n in names):
                (missing if tensor_id in params else buffers_kept).append(names[0])
            continue
        entries.append(LoadEntry(tuple(names), sources[0], tensor_id in params, tuple(sources[1:])))
    problems = strict_load_problems(missing, unexpected, misshapen)
    if problems:
        raise CheckpointMismatchError(
            f"diffusers checkpoint {index.directory} does not fit {type(model).__name__} (strict "
            "loading):\n  - " + "\n  - ".join(problems)
        )
    if ignored:
        log.info("%s: ignoring checkpoint keys the model declares ignorable: %s", index.directory, ignored[:10])
    return LoadPlan(index.directory, tuple(entries), tuple(ignored), tuple(buffers_kept))
