"""``encoder_dp_balance`` for Transformers VLMs: the vision tower's forward deals the group's images out evenly.

:func:`enable_vision_balance` finds the vision towers of a model (a module with a ``spatial_merge_size`` whose
forward takes ``grid_thw``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE's ``model.visual``) and replaces each one's
forward (:func:`lightning_mm.core.module_state.replace_forward`; the model's own forward is unchanged). A call of
the tower with this rank's ``pixel_values`` and ``grid_thw`` then:

1. gathers every rank's grids and computes the same route on every rank
   (:func:`~lightning_mm.core.vision_work_balance.plan_route`);
2. sends each image's patches (whole images) to the rank that encodes it (one all-to-all);
3. runs the tower's own forward once on the images this rank received (a rank that received none encodes a
   one-merge-group dummy image and sends none of its result, so every rank calls the (possibly FSDP-sharded)
   tower once and runs its backward);
4. sends the merged features (``pooler_output``, and Qwen3-VL's ``deepstack_features``) back to the owning rank
   in one all-to-all, in the owner's image order: the model places them at its image tokens as without
   balancing. The backward of the all-to-alls returns the gradients to the encoding rank.

The pre-merger ``last_hidden_state`` is not sent back (the language model reads only the merged features): under
balancing it is ``None``. Every rank of the group must call the tower the same number of times in a step, as
FSDP2 requires of a sharded tower anyway. A training call of the model without images or videos (a text-only row
without the filler image; the model never calls its tower then) calls each balanced tower with no image from a
forward pre-hook of the model, and a forward hook adds the empty features' sum (exactly 0) to the output's loss (or
logits): the rank takes part in both all-to-alls, forward and backward, instead of leaving the others waiting.
Lightning-free.
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mm.core.module_state import replace_forward
from lightning_mm.core.vision_work_balance import (
    CostCalibration,
    ImageRoute,
    VisionCost,
    attention_term,
    exchange_rows,
    gather_grids,
    plan_route,
)
from lightning_mm.errors import ConfigError

__all__ = [
    "VisionBalanceError",
    "BalanceState",
    "enable_vision_balance",
    "enable_from_config",
    "find_vision_towers",
    "balance_state",
]


MERGED_OUTPUTS = ("pooler_output", "deepstack_features")
"""The tower outputs sent back to the owning ranks: one row per merged group of each image."""


class VisionBalanceError(ConfigError):
    """``encoder_dp_balance`` cannot be used with this model or this call."""


@dataclass
class BalanceState:
    """What one balanced tower knows and observed (read by benchmarks and logs)."""

    group: Any
    calibration: CostCalibration
    merge: int
    window: int | None
    full_fraction: float
    last_route: ImageRoute | None = None
    last_seconds: float = 0.0
    """This rank's time in the tower's own forward in the last call."""
    calls: int = 0
    history: list[tuple[float, float]] = field(default_factory=list)
    patch_width: int = 0
    """Values per patch row of ``pixel_values`` (channels x temporal patch x patch side squared)."""


_STATES: weakref.WeakKeyDictionary[nn.Module, BalanceState] = weakref.WeakKeyDictionary()


def balance_state(tower: nn.Module) -> BalanceState | None:
    """The state of a balanced tower (``None``: not balanced)."""
    return _STATES.get(tower)


def find_vision_towers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` with a ``spatial_merge_size`` whose forward takes ``grid_thw``."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if not isinstance(getattr(module, "spatial_merge_size", None), int):
            continue
        try:
            params = inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            continue
        if "grid_thw" in params:
            found.append((name, module))
    return found


def _window_layout(tower: nn.Module) -> tuple[int | None, float]:
    """Qwen2.5-VL's window attention: (window side in patches, share of full-attention layers)."""
    window_size = getattr(tower, "window_size", None)
    patch_size = getattr(tower, "patch_size", None)
    full = getattr(tower, "fullatt_block_indexes", None)
    blocks = getattr(tower, "blocks", None)
    if not (isinstance(window_size, int) and isinstance(patch_size, int) and full is not None and blocks is not None):
        return None, 1.0
    depth = len(blocks)
    return max(window_size // patch_size, 1), (len(list(full)) / depth if depth else 1.0)


def enable_vision_balance(
    model: nn.Module, cost: VisionCost | None, calibration_calls: int, group: Any = None
) -> list[str]:
    """Balance the vision towers of ``model`` over ``group`` (default: all ranks); returns their paths.

    ``cost``: the cost model, or ``None`` to calibrate it on the first ``calibration_calls`` calls of each tower
    (patches alone until then).
    """
    towers = find_vision_towers(model)
    if not towers:
        raise VisionBalanceError(
            f"encoder_dp_balance: {type(model).__name__} has no vision tower that takes `grid_thw` (supported: the "
            "Qwen2-VL, Qwen2.5-VL and Qwen3-VL families); remove `encoder_dp_balance` for this model"
        )
    if not dist.is_initialized():
        raise VisionBalanceError("encoder_dp_balance needs torch.distributed to be initialised")
    for _, tower in towers:
        if tower in _STATES:
            continue
        window, full_fraction = _window_layout(tower)
        calibration = CostCalibration(0 if cost is not None else calibration_calls, cost or VisionCost())
        merge: Any = tower.spatial_merge_size  # an int (find_vision_towers checked it)
        state = BalanceState(group, calibration, int(merge), window, full_fraction, patch_width=_patch_width(tower))
        _STATES[tower] = state
        replace_forward(tower, _balanced(tower.forward, state), "encoder_dp_balance")
    inner = [tower for name, tower in towers if name]
    if inner and model not in _IMAGE_FREE:
        _IMAGE_FREE[model] = (
            model.register_forward_pre_hook(_image_free_call(inner), with_kwargs=True),
            model.register_forward_hook(_tie_empty_features, with_kwargs=True),
        )
    return [name for name, _ in towers]


_IMAGE_FREE: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]] = weakref.WeakKeyDictionary()
_PENDING: weakref.WeakKeyDictionary[nn.Module, list[torch.Tensor]] = weakref.WeakKeyDictionary()
VISUAL_INPUTS = ("pixel_values", "pixel_values_videos")
"""A model call with neither of these does not call its vision tower: the image-free call's hooks do."""


def _patch_width(tower: nn.Module) -> int:
    embed = getattr(tower, "patch_embed", None)
    sizes = [getattr(embed, k, None) for k in ("in_channels", "temporal_patch_size", "patch_size")]
    if not all(isinstance(v, int) for v in sizes):
        raise VisionBalanceError(
            f"encoder_dp_balance: {type(tower).__name__}.patch_embed has no in_channels / temporal_patch_size / "
            "patch_size to size an image-free rank's empty call"
        )
    channels, temporal, side = (int(v) for v in sizes if isinstance(v, int))
    return channels * temporal * side * side


def _image_free_call(towers: list[nn.Module]) -> Callable[..., None]:
    """A training call of the model without images or videos (a text-only batch without the filler image) calls
    each balanced tower with no image: the rank takes part in the group's exchanges (it may encode other ranks'
    images), and :func:`_tie_empty_features` joins the empty features to the output so the backward exchange runs
    on this rank too. Without it the other ranks would wait in the tower's collectives for ever."""

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training or any(kwargs.get(k) is not None for k in VISUAL_INPUTS):
            return
        if kwargs.get("input_ids") is None and kwargs.get("inputs_embeds") is None:
            return
        pending: list[torch.Tensor] = []
        for tower in towers:
            state = _STATES[tower]
            weight = next(tower.parameters())
            device = weight.device if weight.device.type != "meta" else torch.device("cpu")
            pixels = torch.zeros((0, state.patch_width), dtype=weight.dtype, device=device)
            out = tower(pixels, grid_thw=torch.zeros((0, 3), dtype=torch.long, device=device))
            for value in out.values():
                pending += [value] if isinstance(value, torch.Tensor) else [v for v in value if v is not None]
        _PENDING[module] = pending

    return pre_hook


def _tie_empty_features(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """Add the image-free call's empty features (a sum of nothing: exactly 0) to the loss, or else the logits."""
    pending = _PENDING.pop(module, None)
    if not pending:
        return None
    grads = [t.sum() for t in pending if t.requires_grad]
    if not grads:  # a frozen tower: no backward exchange on any rank
        return None
    zero = torch.stack(grads).sum()
    for key in ("loss", "logits"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            setattr(output, key, value + zero.to(value.dtype))
            return output
    raise VisionBalanceError(
        f"encoder_dp_balance: {type(module).__name__} returned neither `loss` nor `logits` to join an image-free "
        "rank's empty vision features to (its backward exchange would be skipped)"
    )


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _balanced(forward: Callable[..., Any], state: BalanceState) -> Callable[..., Any]:
    def balanced_forward(hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        tensors = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        if tensors:
            raise VisionBalanceError(
                f"encoder_dp_balance: the vision tower was called with tensor arguments {tensors}, which cannot be "
                "dealt out per image; call it with pixel values and grid_thw only"
            )
        group = state.group
        rank = dist.get_rank(group)
        cost = state.calibration.cost()
        route = plan_route(gather_grids(grid_thw, group), rank, cost, state.window, state.full_fraction)
        state.last_route = route
        mine = route.mine()
        order = route.send_order()
        own_patches = [route.patches[i] for i in mine]
        if sum(own_patches) != hidden_states.shape[0]:
            raise VisionBalanceError(
                f"encoder_dp_balance: {hidden_states.shape[0]} patch rows for grids holding {sum(own_patches)}"
            )
        pieces = hidden_states.split(own_patches)
        send = torch.cat([pieces[k] for k in order]) if order else hidden_states[:0]
        received = exchange_rows(send, route.send_counts(), route.recv_counts(), group)
        share = route.share()
        merge = state.merge
        if share:
            grids = torch.tensor([route.grids[i] for i in share], dtype=grid_thw.dtype, device=grid_thw.device)
            inputs = received
        else:  # nothing to encode here: a dummy image keeps the tower's collectives (FSDP2) and backward matched
            grids = torch.tensor([[1, merge, merge]], dtype=grid_thw.dtype, device=grid_thw.device)
            inputs = hidden_states.new_zeros((merge * merge, *hidden_states.shape[1:]))
        calibrating = not state.calibration.done
        if calibrating:
            _synchronize(inputs.device)
        start = time.perf_counter()
        out = forward(inputs, grid_thw=grids, **kwargs)
        if calibrating:
            _synchronize(inputs.device)
        state.last_seconds = time.perf_counter() - start
        state.calls += 1
        if calibrating:
            _calibrate(state, route, share)
        return _send_back(out, route, order, bool(share), merge, group)

    return balanced_forward


def _calibrate(state: BalanceState, route: ImageRoute, share: list[int]) -> None:
    patches = float(sum(route.patches[i] for i in share))
    attention = float(sum(attention_term(route.grids[i], state.window, state.full_fraction) for i in share))
    mine = torch.tensor([patches, attention, state.last_seconds], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(state.group))]
    dist.all_gather(gathered, mine, group=state.group)
    state.calibration.add([(float(g[0]), float(g[1]), float(g[2])) for g in gathered])


def _send_back(out: Any, route: ImageRoute, order: list[int], encoded: bool, merge: int, group: Any) -> Any:
    from transformers.utils import ModelOutput

    if not isinstance(out, ModelOutput):
        raise VisionBalanceError(
            f"encoder_dp_balance: the vision tower returned {type(out).__name__}, not a Transformers ModelOutput"
        )
    unit = merge * merge
    fields: dict[str, Any] = {}
    flat: list[torch.Tensor] = []
    layout: list[tuple[str, int | None, torch.Size]] = []  # (field, index in a list or None, trailing shape)
    for key, value in out.items():
        if key == "last_hidden_state":
            continue
        items: list[tuple[int | None, torch.Tensor]] | None = None
        if isinstance(value, torch.Tensor):
            items = [(None, value)]
        elif isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
            items = [(i, v) for i, v in enumerate(value)]
        if items is None or key not in MERGED_OUTPUTS:
            raise VisionBalanceError(
                f"encoder_dp_balance: the vision tower's output `{key}` is not one of the merged per-image features "
                f"{MERGED_OUTPUTS} that balancing returns; turn off output_hidden_states / output_attentions"
            )
        if isinstance(value, (list, tuple)):
            fields[key] = [None] * len(value)
        for index, tensor in items:
            layout.append((key, index, tensor.shape[1:]))
            flat.append(tensor.reshape(tensor.shape[0], -1))
    if not flat:
        raise VisionBalanceError("encoder_dp_balance: the vision tower returned no features")
    joined = torch.cat(flat, dim=1)
    if not encoded:  # the dummy image: nothing to send; the empty slice keeps the tower in this rank's backward
        joined = joined[:0]
    back = exchange_rows(joined, route.recv_counts(unit), route.send_counts(unit), group)
    # the rows arrive grouped by encoder (rank order), each group in global order: this rank's send order
    mine = route.mine()
    sizes = [route.patches[mine[k]] // unit for k in order]
    arrived = back.split(sizes)
    position = {k: j for j, k in enumerate(order)}
    in_order = [arrived[position[k]] for k in range(len(mine))]
    start = 0
    for key, index, trailing in layout:  # each field a new tensor (not a view): FSDP2 hooks its outputs
        width = trailing.numel()
        pieces = [piece[:, start : start + width] for piece in in_order] or [back[:, start : start + width]]
        columns = torch.cat(pieces)
        start += width
        tensor = columns if len(trailing) == 1 else columns.reshape(columns.shape[0], *trailing)
        if index is None:
            fields[key] = tensor
        else:
            fields[key][index] = tensor
    for key, value in out.items():
        if isinstance(value, tuple) and key in fields:
            fields[key] = tuple(fields[key])
    return type(out)(**fields)


def enable_from_config(model: nn.Module, config: Any) -> list[str]:
    """:func:`enable_vision_balance` with an :class:`~lightning_mm.core.config.FSDP2Config`'s ``encoder_dp_balance*``
    keys (nothing when ``encoder_dp_balance`` is off); errors name the key."""
    if not config.encoder_dp_balance:
        return []
    given = config.encoder_dp_balance_cost
    cost = VisionCost(*given) if given is not None else None
    try:
        return enable_vision_balance(model, cost, config.encoder_dp_balance_calibration_steps)
    except VisionBalanceError as err:
        raise config.key_error("encoder_dp_balance", str(err).removeprefix("encoder_dp_balance: ")) from None
