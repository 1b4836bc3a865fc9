"""What a checkpoint holds and where (pure data; no torch.distributed, no files).

A Lightning checkpoint dict is split in two:

* the tensors of ``state_dict`` and ``optimizer_states`` (sharded DTensors, replicated tensors), stored by DCP
  under flat keys such as ``state_dict/model.layers.0.weight`` or ``optimizer_states/0/state/layers.0.weight/exp_avg``;
* everything else (loops, schedulers, callbacks, hyper-parameters, optimiser ``param_groups``), the *meta* tree, in
  which each stored tensor is replaced by a marker ``{MARKER: key}``.

Per-rank state (RNG states, dataloader positions) is taken out of the dict before the split and kept, one entry
per rank, under ``meta[EXTRA_KEY]["ranks"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_mm._utils.suggestions import listing
from lightning_mm.checkpoint.checkpoint_errors import CheckpointError, CheckpointMismatchError

__all__ = [
    "MARKER",
    "EXTRA_KEY",
    "META_FILE",
    "FORMAT_VERSION",
    "TENSOR_ROOTS",
    "KIND_TRAINING",
    "KIND_WEIGHTS",
    "split_tensors",
    "fill_tensors",
    "model_key",
    "KeyPlan",
    "plan_keys",
    "CheckpointKeyError",
    "pop_loader_states",
    "put_loader_states",
]

MARKER = "__lightning_mm_dcp__"
EXTRA_KEY = "lightning_mm"
META_FILE = "meta.pt"
FORMAT_VERSION = 1
TENSOR_ROOTS = ("state_dict", "optimizer_states")
KIND_TRAINING = "training"  # written by a Trainer: resumes model, optimiser, schedulers, loops
KIND_WEIGHTS = "weights"  # model weights only (e.g. converted from Hugging Face): training starts fresh from them
SEP = "/"


def model_key(fqn: str) -> str:
    """The stored key of a model tensor."""
    return f"state_dict{SEP}{fqn}"


def _split(node: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        key = SEP.join(path)
        if key in tensors:
            raise CheckpointMismatchError(f"two tensors of the checkpoint map to the stored key {key!r}")
        tensors[key] = node
        return {MARKER: key}
    if isinstance(node, Mapping):
        return {k: _split(v, (*path, str(k)), tensors) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [_split(v, (*path, str(i)), tensors) for i, v in enumerate(node)]
        return items if isinstance(node, list) else tuple(items)
    return node


def split_tensors(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split a checkpoint dict into ``(meta, tensors)``: the tensors under :data:`TENSOR_ROOTS` go to DCP."""
    tensors: dict[str, torch.Tensor] = {}
    meta = {k: (_split(v, (k,), tensors) if k in TENSOR_ROOTS else v) for k, v in checkpoint.items()}
    return meta, tensors


def _is_marker(node: Any) -> bool:
    return isinstance(node, Mapping) and len(node) == 1 and MARKER in node


def fill_tensors(meta: Any, lookup: Callable[[str], Any]) -> Any:
    """Replace every marker in ``meta`` by ``lookup(key)`` (a new tree; ``meta`` is not modified)."""
    if _is_marker(meta):
        return lookup(meta[MARKER])
    if isinstance(meta, Mapping):
        return {k: fill_tensors(v, lookup) for k, v in meta.items()}
    if isinstance(meta, list):
        return [fill_tensors(v, lookup) for v in meta]
    if isinstance(meta, tuple):
        return tuple(fill_tensors(v, lookup) for v in meta)
    return meta


# ----------------------------------------------------------------------------------------- key checks
class CheckpointKeyError(CheckpointError, KeyError):
    """The checkpoint and the model (or optimiser) do not hold the same keys; the message lists them."""

    def __str__(self) -> str:  # KeyError would show the repr of the message
        return str(self.args[0]) if self.args else ""


@dataclass
class KeyPlan:
    """How the tensors a model expects map onto the tensors a checkpoint stores.

    ``load`` maps each destination key to the stored key it is read from (a tied alias may be read through
    another name); ``missing``, ``unexpected`` and ``mismatched`` are what a strict load refuses and a non-strict
    load skips.
    """

    load: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self, what: str, limit: int = 40) -> str:
        parts = []
        for title, items in (
            ("missing from the checkpoint", self.missing),
            ("unexpected in the checkpoint", self.unexpected),
        ):
            if items:
                shown = listing(items, limit)
                parts.append(f"{len(items)} {what} key(s) {title}: {shown}")
        if self.mismatched:
            shown = ", ".join(f"{k} (checkpoint {list(s)}, model {list(m)})" for k, s, m in self.mismatched[:limit])
            parts.append(f"{len(self.mismatched)} {what} key(s) with a different shape: {shown}")
        return "; ".join(parts)


def plan_keys(
    expected: Mapping[str, tuple[int, ...]],
    stored: Mapping[str, tuple[int, ...]],
    aliases: Iterable[Iterable[str]] = (),
) -> KeyPlan:
    """Match expected keys (with shapes) against stored keys.

    ``aliases`` are groups of expected keys that name one tensor (tied parameters): the group is satisfied when
    any member is stored, and is loaded once.
    """
    group_of: dict[str, tuple[str, ...]] = {}
    for group in aliases:
        members = tuple(k for k in group if k in expected)
        for k in members:
            group_of[k] = members
    plan = KeyPlan()
    done: set[str] = set()
    for key, shape in expected.items():
        if key in done:
            continue
        group = group_of.get(key, (key,))
        done.update(group)
        source = next((k for k in group if k in stored), None)
        if source is None:
            plan.missing.extend(group)
            continue
        if tuple(stored[source]) != tuple(shape):
            plan.mismatched.append((source, tuple(stored[source]), tuple(shape)))
            continue
        plan.load[source] = source
        for other in group:
            if other != source and other in stored and tuple(stored[other]) != tuple(shape):
                plan.mismatched.append((other, tuple(stored[other]), tuple(shape)))
    plan.unexpected = [k for k in stored if k not in expected]
    return plan


# ------------------------------------------------------------------------------------- per-rank state
def _fit_loop_state(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    loops = checkpoint.get("loops")
    if not isinstance(loops, Mapping):
        return None
    fit = loops.get("fit_loop")
    if not isinstance(fit, Mapping):
        return None
    state = fit.get("state_dict")
    return state if isinstance(state, dict) else None


def pop_loader_states(checkpoint: dict[str, Any]) -> Any:
    """Take this rank's dataloader position (Lightning's stateful-loader state) out of the checkpoint dict."""
    state = _fit_loop_state(checkpoint)
    return None if state is None else state.pop("combined_loader", None)


def put_loader_states(checkpoint: dict[str, Any], loader_states: Any) -> None:
    """Put a dataloader position back where Lightning's fit loop restores it from."""
    if loader_states is None:
        return
    state = _fit_loop_state(checkpoint)
    if state is not None:
        state["combined_loader"] = loader_states
