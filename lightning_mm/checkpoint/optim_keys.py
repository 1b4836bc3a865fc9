"""Optimiser state keyed by parameter index (torch's standard layout) or by parameter name (this project's).

``torch.optim.Optimizer.state_dict()``, and so every Lightning strategy that saves it (DDP, single device,
``ModelParallelStrategy``'s full format), keys ``state`` by the parameter's position across the parameter groups
and lists those positions in each group's ``params``. ``get_optimizer_state_dict`` keys both by parameter name
(FQN), which is what a sharded (DCP) checkpoint holds. This module converts between the two (pure data).

torch also keeps a group's ``param_names`` when the optimiser was built over named parameters; they are the
optimiser's own state, so a conversion keeps them when they are there and never adds them: a state saved and
restored is the same dict, key for key. The parameter names of an index-keyed state this project writes are
recorded beside it instead (the checkpoint's ``optimizer_param_names``, :func:`group_param_names`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_mm.checkpoint.checkpoint_errors import CheckpointMismatchError
from lightning_mm.checkpoint.checkpoint_layout import CheckpointKeyError

__all__ = ["PARAM_NAMES", "to_index_keyed", "is_index_keyed", "saved_names", "group_param_names"]

PARAM_NAMES = "param_names"  # torch's own key for the names kept alongside the indices in a parameter group


def group_param_names(state: Mapping[str, Any]) -> list[list[str]]:
    """The parameter names of each group of a name-keyed optimiser state (what its indices stand for once it is
    index-keyed by :func:`to_index_keyed`)."""
    return [[str(p) for p in group.get("params", [])] for group in state.get("param_groups", [])]


def to_index_keyed(state: Mapping[str, Any]) -> dict[str, Any]:
    """A name-keyed optimiser state dict in torch's layout: what ``Optimizer.state_dict()`` gives, indices in
    order of the groups (a group's ``param_names``, the optimiser's own, stay as they are; none are added).

    ``torch.optim.Optimizer.load_state_dict`` of an optimiser over the same parameters (in the same order)
    loads the result. A dict without ``param_groups`` (a non-zero rank's share of a gathered state) is returned
    unchanged.
    """
    groups = state.get("param_groups")
    if not groups:
        return dict(state)
    index: dict[str, int] = {}
    new_groups = []
    for group in groups:
        names = list(group["params"])
        ids = []
        for name in names:
            index.setdefault(name, len(index))
            ids.append(index[name])
        new_groups.append({**group, "params": ids})
    unknown = sorted(str(k) for k in state.get("state", {}) if k not in index)
    if unknown:
        raise CheckpointMismatchError(f"optimizer state for parameters in no parameter group: {unknown}")
    new_state = {index[name]: entries for name, entries in state.get("state", {}).items()}
    return {**state, "state": new_state, "param_groups": new_groups}


def _is_index(key: Any) -> bool:
    return isinstance(key, int) and not isinstance(key, bool)


def is_index_keyed(saved: Mapping[str, Any]) -> bool:
    """Whether a saved optimiser state names its parameters by index (torch's layout)."""
    params = [p for g in saved.get("param_groups", []) for p in g.get("params", [])]
    return bool(params) and all(_is_index(p) for p in params)


def saved_names(
    saved: Mapping[str, Any],
    current_groups: Sequence[Mapping[str, Any]],
    where: str,
    recorded: Sequence[Sequence[str]] | None = None,
    annotated: bool = False,
) -> dict[str, str]:
    """``{str(saved parameter id): parameter name}`` for every parameter of the saved groups.

    A name-keyed state maps each name to itself. An index-keyed state maps through ``recorded`` (the names this
    project records beside the state it writes, per group) when given; else through the names kept in each group
    (``param_names``) when they are this project's (``annotated``: its files from before the record) or name
    parameters of the current groups; else by position, as ``torch.optim.Optimizer.load_state_dict`` does: the
    i-th parameter of the saved groups is the i-th of the current ones (``current_groups``, name-keyed), which
    needs the same number of groups and parameters per group.
    """
    groups = saved.get("param_groups", [])
    if not is_index_keyed(saved):
        mixed = [p for g in groups for p in g.get("params", []) if not isinstance(p, str)]
        if mixed:
            raise CheckpointKeyError(f"{where}: parameter groups mix parameter names and indices ({mixed[:5]})")
        return {p: p for g in groups for p in g.get("params", [])}
    if recorded is not None:
        if [len(g.get("params", [])) for g in groups] != [len(names) for names in recorded]:
            raise CheckpointKeyError(
                f"{where}: the recorded parameter names do not match the parameter groups "
                f"(sizes {[len(n) for n in recorded]} and "
                f"{[len(g.get('params', [])) for g in groups]})"
            )
        return {str(i): str(name) for g, names in zip(groups, recorded) for i, name in zip(g["params"], names)}
    current = {p for g in current_groups for p in g["params"]}
    if (
        groups
        and all(PARAM_NAMES in g for g in groups)
        and (annotated or all(n in current for g in groups for n in g[PARAM_NAMES]))
    ):
        out = {}
        for g in groups:
            if len(g[PARAM_NAMES]) != len(g["params"]):
                raise CheckpointKeyError(
                    f"{where}: a parameter group has {len(g['params'])} parameters and {len(g[PARAM_NAMES])} names"
                )
            out.update({str(i): name for i, name in zip(g["params"], g[PARAM_NAMES])})
        return out
    saved_sizes = [len(g.get("params", [])) for g in groups]
    current_sizes = [len(g["params"]) for g in current_groups]
    if saved_sizes != current_sizes:
        raise CheckpointKeyError(
            f"{where}: the checkpoint keys its optimizer state by parameter index, with parameter groups of sizes "
            f"{saved_sizes}; the optimizer's groups have sizes {current_sizes}, so the indices cannot be mapped to "
            "parameters (as in torch's Optimizer.load_state_dict, the optimizer must be built over the same "
            "parameters in the same order)"
        )
    return {str(i): name for g, now in zip(groups, current_groups) for i, name in zip(g["params"], now["params"])}
