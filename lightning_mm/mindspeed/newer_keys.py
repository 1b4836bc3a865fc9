"""Native-route keys of newer MindSpeed MM versions, each named in the report with what it would need here.

At the pinned commit (57069cd5) ``features.activation_offload_plan``, ``training.quantization_plan`` and
``training.plugin`` exist; ``swap_plan``, ``recompute_plan.op_replay_scopes``, ``enable_grad_norm_overlap`` and a
context-parallel size for the KV all-gather algorithm do not (``git grep`` of ``mindspeed_mm/`` finds none). Their
exact place in a newer YAML is not known here, so a key is recognised by its name wherever it sits. Each is NOT
mapped: a config that sets one does not train as written, and the report says what it would take.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["NEWER_KEYS", "name_newer_keys"]

NEWER_KEYS: dict[str, str] = {
    "swap_plan": "tensor swapping between device and host memory by plan: would need a swap hook around the listed "
    "modules' saved tensors (torch.autograd.graph.saved_tensors_hooks with host copies); recompute_modules in the "
    "FSDP2 config trade compute for the same memory",
    "activation_offload_plan": "activation offload to host memory for the listed modules: would need saved-tensor "
    "hooks that move activations to pinned host memory and back (torch.autograd.graph.save_on_cpu per module)",
    "op_replay_scopes": "recomputation of selected operators inside a recomputed module: would need selective "
    "activation checkpointing (torch.utils.checkpoint's context_fn / SAC policy) per scope; here a recomputed module "
    "is recomputed whole",
    "enable_grad_norm_overlap": "the gradient-norm reduction overlapped with the backward pass: would need the norm "
    "computed per FSDP unit in a post-backward hook; here the norm is computed once after the backward (same value)",
    "quantization_plan": "low-precision (FP8 / MXFP8) training of the listed modules: would need a quantised linear "
    "(torchao's float8 training) applied before fully_shard and checkpoints that keep the high-precision weights",
    "kv_all_gather": "context parallelism that all-gathers keys and values across the group, in a MindSpeed MM newer "
    "than the pinned commit: would need that version's meaning of the key pinned before mapping it; the algorithm is "
    "here as the FSDP2 config's context_parallel_size with context_parallel_algo: kv_allgather",
    "plugin": "MindSpeed MM's plugin modules (its own model / dataset classes, imported by path): would need the "
    "plugin's classes as a model_provider / train_valid_test_datasets_provider here; they are not imported",
}
"""Key name -> what it would need here."""

_KV_ALL_GATHER = re.compile(r"(kv.*all_?gather|all_?gather.*kv)", re.IGNORECASE)


def _leaves(node: Mapping[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in node.items():
        name = f"{prefix}{key}"
        out.append(name)
        if isinstance(value, Mapping):
            out += _leaves(value, f"{name}.")
    return out


def _newer(path: str) -> str | None:
    leaf = path.rsplit(".", 1)[-1]
    if leaf in NEWER_KEYS and leaf != "kv_all_gather":
        return leaf
    if _KV_ALL_GATHER.search(leaf) and path.startswith("parallel."):
        return "kv_all_gather"
    return None


def name_newer_keys(data: Mapping[str, Any], mapped: list[str], notes: list[str], unmapped: list[str]) -> list[str]:
    """Rewrite the report's entries for the newer keys in ``data``: each becomes one NOT-mapped entry saying what it
    would need (a plan that is switched off or empty stays a note). Returns the keys found."""
    found: list[str] = []
    for path in _leaves(data):
        key = _newer(path)
        if key is None or any(path.startswith(f"{f}.") for f in found):
            continue
        found.append(path)
        for entries in (mapped, notes, unmapped):
            entries[:] = [e for e in entries if not e.startswith((f"{path}:", f"{path} ", f"{path}."))]
        value: Any = data
        for part in path.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        parent: Any = data
        for part in path.split(".")[:-1]:
            parent = parent.get(part) if isinstance(parent, Mapping) else None
        switch = f"enable_{key.removesuffix('_plan')}"
        # MindSpeed MM reads activation_offload_plan only with enable_activation_offload (default off); another
        # plan is off when its switch is written and false
        default_on = key != "activation_offload_plan"
        switched_off = isinstance(parent, Mapping) and not parent.get(switch, default_on)
        switch_path = f"{path.rsplit('.', 1)[0]}.{switch}" if "." in path else switch
        for entries in (mapped, notes, unmapped):
            entries[:] = [e for e in entries if not e.startswith((f"{switch_path}:", f"{switch_path},"))]
        shown = f"{switch_path}, {path}" if isinstance(parent, Mapping) and switch in parent else path
        own = key == "plugin" and isinstance(value, list) and all(str(v).startswith("mindspeed_mm/") for v in value)
        if own:
            notes.append(
                f"{path}: MindSpeed MM's own plugins (they register its model and dataset classes); this project's "
                "classes are used. A plugin of your own " + NEWER_KEYS[key].split(": ", 1)[1]
            )
        elif switched_off or value in (None, False, [], {}) or (isinstance(value, Mapping) and not any(value.values())):
            notes.append(f"{shown}: off or empty, nothing to do; when on: {NEWER_KEYS[key]}")
        else:
            unmapped.append(f"{shown}: not supported here: {NEWER_KEYS[key]}")
    return found
