"""The checkpoint entry point: every rank calls :func:`save` and :func:`load`; this module holds the load.

A ``torch_dcp`` checkpoint is a directory::

    step=100.ckpt/
        .metadata, __0_0.distcp, __1_0.distcp, ...   model and optimiser tensors (DCP, written by every rank)
        meta.pt                                      everything else (rank 0), loadable weights_only
        manifest.json                                every file's size and hashes, written last (:mod:`.manifest`)

A ``torch`` checkpoint is one file with the full (gathered) tensors in Lightning's layout, written by rank 0, its
manifest a record of its zip archive (:mod:`.zip_manifest`). Both are written next to their final path and renamed
into place when complete (:mod:`.atomic`). Every load checks every byte against the manifest first, the ranks of a
distributed load sharing the hashing and agreeing on the outcome (:func:`.source.open_agreed`).

Here: :func:`load` (model and optimiser state in place, key checks, strict or not, this rank's dataloader positions
and RNG state) and :class:`Loaded`. The rest lives in modules of one concern each, re-exported here under the same
names (``store.save``, ``store.open_source``, ...):

* :mod:`.rank_agreement`: the collectives by which the ranks agree (rank 0's value everywhere, a gather to rank 0,
  a barrier, an error raised on every rank);
* :mod:`.state`: taking the model's and the optimisers' state (:func:`model_state`, :func:`optimizer_state`,
  :data:`StateView`, :func:`gather_full`, :func:`optimizer_param_names`, :func:`alias_groups`, :func:`copy_loops`);
* :mod:`.writer`: :func:`save` (staging, the write, the manifest, the commit) and :func:`write_file`;
* :mod:`.source`: :class:`CheckpointSource`, :func:`open_source` and :func:`open_agreed` (opening a checkpoint,
  checked against its manifest, and reading its tensors);
* :mod:`.regroup`: the saved parameter groups merged over the current ones, regrouped where the same parameters
  are split differently, and the LR schedulers' per-group lists with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from lightning_mm._compat import unwrap_optimizer
from lightning_mm._utils.distributed import rank_zero_warn
from lightning_mm.checkpoint.checkpoint_errors import CheckpointMismatchError
from lightning_mm.checkpoint.checkpoint_layout import (
    EXTRA_KEY,
    FORMAT_VERSION,
    KIND_TRAINING,
    KIND_WEIGHTS,
    SEP,
    CheckpointKeyError,
    KeyPlan,
    model_key,
    plan_keys,
    put_loader_states,
)
from lightning_mm.checkpoint.optim_keys import PARAM_NAMES, saved_names
from lightning_mm.checkpoint.rank_agreement import (
    broadcast_from_rank_zero,
    gather_to_rank_zero,
    is_distributed,
    raise_on_every_rank,
)
from lightning_mm.checkpoint.record_providers import check_records
from lightning_mm.checkpoint.regroup import merge_param_groups, remap_scheduler
from lightning_mm.checkpoint.source import CheckpointSource, open_agreed, open_source, single_process_quiet
from lightning_mm.checkpoint.state import (
    OPTIMIZER_NAMES_KEY,
    StateView,
    alias_groups,
    copy_loops,
    gather_full,
    model_state,
    optimizer_param_names,
    optimizer_state,
)
from lightning_mm.checkpoint.writer import FORMATS, save, write_file
from lightning_mm.core.grad_mode import outside_inference_mode

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
    (:func:`.regroup.merge_param_groups`)."""
    optim = unwrap_optimizer(optimizer)
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
    groups, sources = merge_param_groups(current["param_groups"], saved["param_groups"], source.path, index, strict)
    set_optimizer_state_dict(
        model, optim, {"state": state, "param_groups": groups}, options=StateDictOptions(strict=False)
    )  # keys were checked above
    return [*plan.missing, *plan.unexpected, *(k for k, _, _ in plan.mismatched)], sources


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
        raise CheckpointMismatchError(
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
        raise CheckpointMismatchError(
            f"{path} holds no optimizer state (saved with `save_weights_only=True`?): it cannot resume training. "
            "Use it with validate/test/predict, or convert it to a weights checkpoint"
        )
    if len(saved) != len(optimizers):
        raise CheckpointMismatchError(
            f"{path} holds state for {len(saved)} optimizer(s); the module has {len(optimizers)}"
        )
    for i, optimizer in enumerate(optimizers):
        missed, sources = _load_optimizer(source, model, optimizer, i, strict, view)
        skipped += missed
        if sources is None:
            continue
        # Schedulers keep lists with one entry per parameter group: regrouped as the optimiser was.
        saved_groups = len(saved[i].get("param_groups", []))
        states = checkpoint.get("lr_schedulers") or []
        owners = [
            next((j for j, o in enumerate(optimizers) if unwrap_optimizer(o) is getattr(s, "optimizer", None)), None)
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
            remap_scheduler(st, sources, saved_groups) if owner == i else st for st, owner in zip(states, owners)
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
