"""Gradient clipping over DTensors: torch's public ``get_total_norm`` / ``clip_grads_with_norm_`` against
``lightning_mm.core.grad_clip``, on 2 real gloo ranks:
``torchrun --nproc-per-node 2 tests/scenarios/clip_scenarios.py clip OUTDIR`` (tests/helpers/scenario_kit.py,
``launcher="torchrun"``).

Cases: FSDP (1-D mesh) gradients, the same plus plain (ignored-module) gradients, HSDP (2 x 1 and 1 x 2
replicate x shard meshes), DTensors on two different meshes, and bf16 gradients. Each rank writes
``OUTDIR/clip.rank{R}.json`` with, per case, today's norm, torch's norm (per mesh group, combined), a norm of the
gathered gradients in float64, and the largest difference of the clipped gradients between the two paths.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm.core.grad_clip import clip_grad_norm_, total_grad_norm  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402


def torch_total_grad_norm(params: list[nn.Parameter], norm_type: float) -> torch.Tensor:
    """torch's public ``get_total_norm`` per group of gradients it accepts together (one mesh and placement, or
    plain tensors), each group's DTensor norm made whole with ``full_tensor()``, the groups combined."""
    norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)) for group in _groups(params)]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _groups(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters by the mesh and placements of their gradients (plain gradients together)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        key = (id(g.device_mesh), g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def torch_clip(params: list[nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """torch's public ``clip_grads_with_norm_`` per mesh group (it refuses mixed meshes and mixed plain/DTensor
    gradients), the plain norm replicated implicitly onto each group's mesh."""
    with implicit_replication():
        for group in _groups(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _model(seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(37, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5)).to(dtype)


def _grads(case: str, rank: int) -> list[nn.Parameter]:
    """Parameters with gradients as FSDP2 leaves them for ``case``."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    world = dist.get_world_size()
    meshes = {
        "fsdp": init_device_mesh("cpu", (world,)),
        "hsdp_2x1": init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")),
        "hsdp_1x2": init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")),
    }
    model = _model(0, dtype)
    plain = nn.Linear(5, 3).to(dtype)  # an ignored module: plain tensors, identical on every rank
    mesh = meshes["hsdp_2x1" if case == "hsdp_2x1" else "hsdp_1x2" if case == "hsdp_1x2" else "fsdp"]
    if case == "two_meshes":
        fully_shard(model[0], mesh=meshes["hsdp_1x2"])
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(8, 37, generator=g).to(dtype)
    out = model(x)
    (plain(out).square().mean() * 50).backward()
    params = list(model.parameters())
    if case in ("mixed", "two_meshes", "bf16"):
        for p in plain.parameters():  # ignored-module grads are all-reduced by the strategy: same on every rank
            dist.all_reduce(p.grad)
        params += list(plain.parameters())
    return params


def _reference(params: list[nn.Parameter], norm_type: float) -> float:
    grads = [_full(p.grad).double().flatten() for p in params]
    return float(torch.linalg.vector_norm(torch.cat(grads), norm_type))


def _case(case: str, rank: int, norm_type: float, max_norm: float) -> dict[str, Any]:
    ours_params = _grads(case, rank)
    theirs_params = _grads(case, rank)
    ours = float(total_grad_norm(ours_params, norm_type))
    theirs = torch_total_grad_norm(theirs_params, norm_type)
    reference = _reference(ours_params, norm_type)
    clip_grad_norm_(ours_params, max_norm, norm_type)
    torch_clip(theirs_params, max_norm, theirs)
    diff = 0.0
    rel = 0.0
    for a, b in zip(ours_params, theirs_params):
        la, lb = _full(a.grad).double(), _full(b.grad).double()
        diff = max(diff, float((la - lb).abs().max()))
        rel = max(rel, float(((la - lb).abs() / la.abs().clamp(min=1e-30)).max()))
    return {
        "ours": ours,
        "torch": float(theirs),
        "reference": reference,
        "clipped_max_abs_diff": diff,
        "clipped_max_rel_diff": rel,
        "clipped_equal": diff == 0.0,
    }


@scenario
def clip(outdir: Path) -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT from torchrun
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for case in ("fsdp", "mixed", "hsdp_2x1", "hsdp_1x2", "two_meshes", "bf16"):
        for norm_type in (2.0, 1.0, math.inf):
            results[f"{case}/{norm_type}"] = _case(case, rank, norm_type, max_norm=0.05)
    Path(outdir, f"clip.rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    scenario_kit.main()
