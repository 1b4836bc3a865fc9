"""Balancing the vision tower's work over the data-parallel ranks: the cost model, the assignment, the exchange.

In VLM training each rank encodes the images of its own micro-batch, and a rank with a 2,048-patch scan keeps the
others waiting at the language model's first collective. With ``encoder_dp_balance`` (MindSpeed MM's name for its
Megatron-route flag) the images of all ranks are dealt out again before the tower runs:

* every image gets an estimated cost ``linear * patches + quadratic * attention`` (:class:`VisionCost`), where
  ``attention`` is the sum of squared attention spans (:func:`attention_term`: the whole frame for full-attention
  layers, each window for Qwen2.5-VL's window layers);
* :func:`assign_images` deals the images to ranks by longest-processing-time first (largest cost first, each to the
  least loaded rank; ties to the image's owner, then the lowest rank): deterministic, so every rank computes the
  same assignment from the same gathered grids, with no extra collective;
* :func:`exchange_rows` moves whole images' rows between ranks with one ``all_to_all_single`` (gloo and NCCL
  both take uneven splits); its backward is the reverse all-to-all, so gradients return to the rank that encoded
  an image exactly;
* :class:`CostCalibration` fits ``linear`` and ``quadratic`` on the first calls from the measured tower times of
  every rank (gathered, so every rank fits the same numbers).

The Transformers hook that uses these is :mod:`lightning_mm.hf.vision_tower_balance`. Lightning-free.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "VisionCost",
    "attention_term",
    "assign_images",
    "ImageRoute",
    "plan_route",
    "exchange_rows",
    "CostCalibration",
    "load_spread",
]


@dataclass(frozen=True)
class VisionCost:
    """The cost of encoding one image: ``linear * patches + quadratic * attention`` (arbitrary units)."""

    linear: float = 1.0
    quadratic: float = 0.0

    def __call__(self, patches: int, attention: float) -> float:
        return self.linear * patches + self.quadratic * attention


def attention_term(grid: Sequence[int], window: int | None = None, full_fraction: float = 1.0) -> float:
    """The attention work of one image of ``grid = (t, h, w)`` patches: the mean over the tower's layers of the
    sum of squared attention spans.

    A full-attention layer attends within each frame (``h * w`` patches, ``t`` frames: ``t * (h*w)^2``). A window
    layer (Qwen2.5-VL) attends within square windows of ``window`` patches a side, the last row and column of
    windows cut by the image's edge. ``full_fraction`` is the share of full-attention layers (1 without windows).
    """
    t, h, w = (int(v) for v in grid)
    full = t * float(h * w) ** 2
    if window is None or window <= 0 or full_fraction >= 1.0:
        return full

    def spans(n: int) -> list[int]:
        return [min(window, n - start) for start in range(0, n, window)]

    windowed = t * float(sum((a * b) ** 2 for a in spans(h) for b in spans(w)))
    return full_fraction * full + (1.0 - full_fraction) * windowed


def assign_images(costs: Sequence[float], owners: Sequence[int], world: int) -> list[int]:
    """The rank that encodes each image: longest-processing-time first over ``costs``.

    Images in decreasing cost (ties: the lower index first) each go to the least loaded rank; among equally loaded
    ranks the image's owner (no transfer), else the lowest rank. Deterministic: equal inputs give equal outputs on
    every rank.
    """
    if len(costs) != len(owners):
        raise ValueError(f"{len(costs)} costs for {len(owners)} images")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [0.0] * world
    heap = [(0.0, r) for r in range(world)]  # (load, rank): the least loaded, lowest rank first
    out = [0] * len(costs)
    for i in order:
        least = heap[0][0]
        owner = owners[i]
        target = owner if loads[owner] == least else heap[0][1]
        loads[target] += costs[i]
        out[i] = target
        heap = [(load, r) for r, load in enumerate(loads)]
        heapq.heapify(heap)
    return out


def load_spread(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads (1.0: even; ``nan`` when all are zero)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else math.nan


@dataclass
class ImageRoute:
    """Where each image of one tower call goes: this rank's view of the group-wide assignment.

    Images are numbered globally in rank order (rank 0's images first, each rank's in its own order). Rows are the
    image's patches (or any per-image unit: :meth:`counts` scales them).
    """

    rank: int
    world: int
    owners: list[int]
    """The rank that holds each image (global order)."""
    encoders: list[int]
    """The rank that encodes each image (global order)."""
    patches: list[int]
    """Each image's patch count (``t * h * w``)."""
    grids: list[tuple[int, int, int]]
    costs: list[float] = field(default_factory=list)

    def share(self) -> list[int]:
        """The global indices of the images this rank encodes, in global order (the order they arrive in)."""
        return [i for i, e in enumerate(self.encoders) if e == self.rank]

    def mine(self) -> list[int]:
        """The global indices of this rank's own images, in its order."""
        return [i for i, o in enumerate(self.owners) if o == self.rank]

    def send_counts(self, unit: int = 1) -> list[int]:
        """Rows this rank sends to each rank (its own images, by their encoder), ``patches // unit`` per image."""
        out = [0] * self.world
        for i in self.mine():
            out[self.encoders[i]] += self.patches[i] // unit
        return out

    def recv_counts(self, unit: int = 1) -> list[int]:
        """Rows this rank receives from each rank (its share, by owner)."""
        out = [0] * self.world
        for i in self.share():
            out[self.owners[i]] += self.patches[i] // unit
        return out

    def send_order(self) -> list[int]:
        """Positions (in this rank's own image order) sorted by destination rank: the order images are sent in."""
        mine = self.mine()
        return sorted(range(len(mine)), key=lambda k: (self.encoders[mine[k]], k))

    def loads(self) -> list[float]:
        """The estimated cost each rank encodes under this route."""
        out = [0.0] * self.world
        for i, e in enumerate(self.encoders):
            out[e] += self.costs[i]
        return out

    def unbalanced_loads(self) -> list[float]:
        """The estimated cost each rank would encode without balancing."""
        out = [0.0] * self.world
        for i, o in enumerate(self.owners):
            out[o] += self.costs[i]
        return out


def gather_grids(grids: torch.Tensor, group: Any = None) -> list[list[tuple[int, int, int]]]:
    """Every rank's ``(n, 3)`` image grids (a CPU all-gather of the counts, then of the padded grids)."""
    world = dist.get_world_size(group)
    local = grids.detach().to("cpu", torch.int64).reshape(-1, 3)
    device = _collective_device(group)
    count = torch.tensor([local.shape[0]], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    ns = [int(c.item()) for c in counts]
    padded = torch.zeros(max(ns), 3, dtype=torch.int64)
    padded[: local.shape[0]] = local
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [[(int(a), int(b), int(c)) for a, b, c in g[:n].tolist()] for g, n in zip(gathered, ns)]


def plan_route(
    all_grids: Sequence[Sequence[tuple[int, int, int]]],
    rank: int,
    cost: VisionCost,
    window: int | None = None,
    full_fraction: float = 1.0,
) -> ImageRoute:
    """The route of one tower call from every rank's grids (:func:`gather_grids`): costs, then
    :func:`assign_images`."""
    owners = [r for r, grids in enumerate(all_grids) for _ in grids]
    grids = [tuple(g) for gs in all_grids for g in gs]
    patches = [t * h * w for t, h, w in grids]
    costs = [max(cost(p, attention_term(g, window, full_fraction)), 1e-12) for p, g in zip(patches, grids)]
    encoders = assign_images(costs, owners, len(all_grids))
    return ImageRoute(rank, len(all_grids), owners, encoders, patches, grids, costs)  # type: ignore[arg-type]


def _collective_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return torch.device(acc.type, torch.accelerator.current_device_index())


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward: the reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(tensor, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(tensor: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    if tensor.shape[0] != sum(send):
        raise ValueError(f"exchange: {tensor.shape[0]} rows to send, the route says {sum(send)}")
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def exchange_rows(tensor: torch.Tensor, send: list[int], recv: list[int], group: Any = None) -> torch.Tensor:
    """Send ``send[r]`` leading rows (in rank order) of ``tensor`` to rank ``r`` and receive ``recv[r]`` rows from
    each; differentiable (the gradient of the result goes back to the sender's rows)."""
    result: torch.Tensor = _Exchange.apply(tensor, list(send), list(recv), group)
    return result


@dataclass
class CostCalibration:
    """Fits :class:`VisionCost` from measured tower times: ``time ~ linear * patches + quadratic * attention``.

    Every rank adds the same gathered samples (one per rank and call), so every rank fits the same numbers. Until
    ``calls`` calls are measured, ``initial`` is used; then the non-negative least-squares fit (a coefficient that
    would be negative is dropped and the other refitted), scaled to patches' units.
    """

    calls: int
    initial: VisionCost = field(default_factory=VisionCost)
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    fitted: VisionCost | None = None
    seen: int = 0

    @property
    def done(self) -> bool:
        return self.fitted is not None or self.calls <= 0

    def cost(self) -> VisionCost:
        return self.fitted or self.initial

    def add(self, samples: Sequence[tuple[float, float, float]]) -> None:
        """Add one call's ``(patches, attention, seconds)`` of every rank; fit after ``calls`` calls."""
        self.samples.extend(s for s in samples if s[0] > 0)
        self.seen += 1
        if self.seen >= self.calls and self.fitted is None:
            self.fitted = fit_cost(self.samples)


def fit_cost(samples: Sequence[tuple[float, float, float]]) -> VisionCost:
    """Non-negative least squares of ``seconds ~ a * patches + b * attention`` over ``samples``, returned as
    ``VisionCost(1, b / a)`` (costs are compared, not added to times); ``VisionCost()`` when nothing fits."""
    if not samples:
        return VisionCost()
    x = torch.tensor([[p, q] for p, q, _ in samples], dtype=torch.float64)
    y = torch.tensor([s for _, _, s in samples], dtype=torch.float64)
    scale = x.abs().amax(0).clamp_min(1e-30)
    xs = x / scale
    a = b = 0.0
    solution = torch.linalg.lstsq(xs, y.unsqueeze(1)).solution.squeeze(1) / scale
    if float(solution[0]) > 0 and float(solution[1]) >= 0:
        a, b = float(solution[0]), float(solution[1])
    else:  # one coefficient alone: the better of the two non-negative fits
        best = math.inf
        for col in (0, 1):
            v = xs[:, col]
            coef = float((v @ y) / (v @ v).clamp_min(1e-30))
            if coef <= 0:
                continue
            err = float(((v * coef - y) ** 2).sum())
            if err < best:
                best = err
                a, b = (coef / float(scale[0]), 0.0) if col == 0 else (0.0, coef / float(scale[1]))
    if a > 0:
        return VisionCost(1.0, b / a)
    if b > 0:
        return VisionCost(0.0, 1.0)
    return VisionCost()
