"""Regrouping on load: an optimiser's saved parameter groups merged over its current ones (saved hyper-parameters,
current parameters and implementation keys), also when the same parameters are split into groups differently; and
the LR schedulers' per-group lists put into the current groups' order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mm._utils.distributed import rank_zero_info, rank_zero_warn
from lightning_mm.checkpoint.checkpoint_layout import CheckpointKeyError
from lightning_mm.checkpoint.optim_keys import PARAM_NAMES
from lightning_mm.core.optimizer import IMPLEMENTATION_KEYS

__all__ = ["merge_param_groups", "remap_scheduler"]


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


def merge_param_groups(
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


def remap_scheduler(state: Any, sources: list[int], saved_groups: int) -> Any:
    """A scheduler's per-group lists (``base_lrs``, ``_last_lr``, ...) in the current groups' order."""
    if not isinstance(state, dict):
        return state
    out = {}
    for key, value in state.items():
        if key in _PER_GROUP and isinstance(value, (list, tuple)) and len(value) == saved_groups:
            value = [value[j] for j in sources]
        elif key == "_schedulers" and isinstance(value, list):
            value = [remap_scheduler(v, sources, saved_groups) for v in value]
        out[key] = value
    return out
