"""``encoder_dp_balance`` against the unbalanced run, on real gloo ranks:
``torchrun --nproc-per-node N tests/scenarios/vision_balance_scenarios.py exactness OUTDIR``
(tests/helpers/scenario_kit.py, ``launcher="torchrun"``; N = 2 and 4).

Each case trains a tiny random model of a real Transformers VLM class (Qwen2.5-VL with window attention, Qwen3-VL
with deepstack features), FSDP2-sharded (each vision block, the tower, each decoder layer, the root), for
``STEPS`` steps twice from the same weights over the same batches: without balancing (the reference) and with the
tower's forward balanced (:func:`lightning_mm.hf.vision_tower_balance.enable_vision_balance`). Each rank's batch is a
row of several samples' images (as packing and token budgets give): rank 0 holds the large images, so the
balanced run moves images between ranks. Variants: recomputation of the vision blocks and decoder layers, a frozen
tower, and a cost model calibrated on the first calls. Every rank writes, per case, the global loss of each step
of both runs, the largest relative weight difference after the last step, the images each rank encoded and the
estimated load spread (max/mean) with and without balancing.

Then Qwen2.5-VL (saved with ``save_pretrained``, loaded by ``TransformersModel``) trains through
``MMFSDP2Strategy`` with and without the ``encoder_dp_balance`` YAML keys (SGD): on 4 ranks under 2-way context
parallelism (the tower runs on whole sequences on each rank of a context-parallel pair; balancing deals the images
over all 4 ranks).

``empty_share`` calls a balanced tower directly with no images on the last rank (its share is empty: it encodes a
dummy image) and compares the features and gradients with the plain tower's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm.core.module_state import replace_forward  # noqa: E402
from lightning_mm.core.packed_rows import PackedCollator  # noqa: E402
from lightning_mm.core.recompute import checkpointed_forward  # noqa: E402
from lightning_mm.core.vision_work_balance import VisionCost, load_spread  # noqa: E402
from lightning_mm.hf.packed_inputs import install_packed_inputs  # noqa: E402
from lightning_mm.hf.vision_tower_balance import balance_state, enable_vision_balance  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.qwen3_vl_family import VISION_END, VISION_START, tiny_qwen3_vl  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402
from tests.scenarios.hf_scenarios import IMAGE_TOKEN, VOCAB, tiny_hf_model  # noqa: E402

STEPS = 3
PATCH = 3 * 2 * 14 * 14  # both tiny towers: 14-pixel patches, temporal_patch_size 2
# Rank -> samples -> image grids (t, h, w in patches). Rank 0 holds the large images (long-tailed mix).
GRIDS: list[list[list[tuple[int, int, int]]]] = [
    [[(1, 8, 8), (1, 4, 6)], [(1, 6, 8)]],
    [[(1, 2, 2)], [(1, 2, 4)]],
    [[(1, 4, 2)], [(1, 2, 2), (1, 2, 2)]],
    [[(1, 2, 6)]],
]


def build(family: str) -> nn.Module:
    return tiny_hf_model("qwen2_5_vl", seed=3) if family == "qwen2_5_vl" else tiny_qwen3_vl(seed=3)


def batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s batch of ``step``: its samples' rows (text, then each image as start, tokens, end), padded
    right; image tokens and padding carry no label."""
    g = torch.Generator().manual_seed(100 * step + rank)
    rows, pixels, grids = [], [], []
    for images in GRIDS[rank % len(GRIDS)]:
        row = torch.randint(10, VOCAB, (3,), generator=g).tolist()
        for t, h, w in images:
            row += [VISION_START] + [IMAGE_TOKEN] * (t * h * w // 4) + [VISION_END]
            row += torch.randint(10, VOCAB, (2,), generator=g).tolist()
            pixels.append(torch.randn(t * h * w, PATCH, generator=g))
            grids.append((t, h, w))
        rows.append(row)
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    labels = ids.masked_fill((ids == IMAGE_TOKEN) | (mask == 0), -100)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.tensor(grids),
        "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
    }


def prepare(family: str, recompute: bool, freeze: bool, balance: bool, cost: VisionCost | None) -> nn.Module:
    model = build(family)
    model.train()
    inner: Any = model.model
    visual, layers = inner.visual, inner.language_model.layers
    if freeze:
        visual.requires_grad_(False)
    blocks = list(visual.blocks) + list(layers)
    if recompute:
        for block in blocks:
            replace_forward(block, checkpointed_forward(block.forward, True, "block"), "recompute_modules")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(visual, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if balance:
        enable_vision_balance(model, cost, calibration_calls=2)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(
    model: nn.Module, make: Callable[[int, int], dict[str, torch.Tensor]] = batch, replicated: bool = False
) -> tuple[list[float], dict[str, torch.Tensor], list[dict[str, Any]]]:
    """``STEPS`` SGD steps on ``make(rank, step)``; ``replicated``: a model whole on every rank (no FSDP), its
    gradients averaged over the ranks here (the reference for a step FSDP2 cannot take unbalanced)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    losses, routes = [], []
    rank = dist.get_rank()
    for step in range(STEPS):
        loss = model(**make(rank, step)).loss
        loss.backward()
        if replicated:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
        state = balance_state(model.model.visual)  # type: ignore[union-attr, arg-type]
        if state is not None and state.last_route is not None:
            route = state.last_route
            routes.append(
                {
                    "encoders": route.encoders,
                    "owners": route.owners,
                    "spread": load_spread(route.loads()),
                    "unbalanced_spread": load_spread(route.unbalanced_loads()),
                    "cost": [state.calibration.cost().linear, state.calibration.cost().quadratic],
                    "fitted": state.calibration.fitted is not None,
                }
            )
    weights = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    return losses, weights, routes


CASES = [
    ("qwen2_5_vl", False, False, VisionCost(1.0, 0.05)),
    ("qwen2_5_vl", True, False, VisionCost(1.0, 0.05)),
    ("qwen2_5_vl", False, True, None),  # frozen tower, calibrated cost model
    ("qwen3_vl", False, False, VisionCost(1.0, 0.0)),
    ("qwen3_vl", True, False, None),
    ("qwen3_vl", False, True, VisionCost(0.0, 1.0)),
]


# Packed rows (PackedCollator, as MMDataModule(packing=True, max_tokens_per_rank=...) builds them): rank -> samples
# -> image grids; a sample without grids is text only. "images": 3 images in rank 0's row, 2 in rank 1's (with a
# text-only sample between); "filler" and "text": rank 1's row holds text only, with or without the filler image.
PACKED: dict[str, list[list[list[tuple[int, int, int]]]]] = {
    "images": [[[(1, 8, 8), (1, 4, 6)], [(1, 6, 8)]], [[(1, 2, 2)], [], [(1, 2, 4)]]],
    "filler": [[[(1, 8, 8), (1, 4, 6)], [(1, 6, 8)]], [[], []]],
    "text": [[[(1, 8, 8), (1, 4, 6)], [(1, 6, 8)]], [[], []]],
}
FILLER_GRID = (1, 2, 2)


def _sample(g: torch.Generator, images: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    """One unpadded sample: text, then each image (start, tokens, end) and text; image tokens carry no label."""
    ids = torch.randint(10, VOCAB, (3,), generator=g).tolist()
    pixels = []
    for t, h, w in images:
        ids += [VISION_START] + [IMAGE_TOKEN] * (t * h * w // 4) + [VISION_END]
        ids += torch.randint(10, VOCAB, (2,), generator=g).tolist()
        pixels.append(torch.randn(t * h * w, PATCH, generator=g))
    row = torch.tensor(ids)
    sample = {
        "input_ids": row,
        "labels": row.masked_fill(row == IMAGE_TOKEN, -100),
        "mm_token_type_ids": (row == IMAGE_TOKEN).long(),
    }
    if images:
        sample["pixel_values"] = torch.cat(pixels)
        sample["image_grid_thw"] = torch.tensor(images)
    return sample


def _filler() -> dict[str, torch.Tensor]:
    """A filler image's sample as the chat builders make it (their ``filler()``: the image's tokens and pixels)."""
    t, h, w = FILLER_GRID
    ids = torch.tensor([VISION_START] + [IMAGE_TOKEN] * (t * h * w // 4) + [VISION_END])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
        "pixel_values": torch.randn(t * h * w, PATCH, generator=torch.Generator().manual_seed(7)),
        "image_grid_thw": torch.tensor([FILLER_GRID]),
    }


def packed_batch(variant: str) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Rank ``rank``'s packed row of ``step``: :class:`PackedCollator` over its samples (``position_ids``
    restarting per sample, no ``attention_mask``; the model's packed-input hook adds the M-RoPE positions)."""
    collate = PackedCollator(filler=_filler() if variant == "filler" else None)

    def make(rank: int, step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + 100 * step + rank)
        return collate([_sample(g, images) for images in PACKED[variant][rank]])

    return make


def packed_cases(outdir: Path) -> None:
    """Qwen2.5-VL on packed rows (2 ranks): balanced against unbalanced FSDP2 with images on both ranks and with
    a text-only row plus the filler image; a text-only row without the filler (the tower is never called there
    unbalanced, so FSDP2 cannot take that step) against the model replicated on each rank."""
    results: dict[str, Any] = {}
    for variant in PACKED:
        make = packed_batch(variant)
        runs = {}
        for balance in (False, True):
            torch.manual_seed(0)
            if variant == "text" and not balance:
                model = build("qwen2_5_vl")
                model.train()
            else:
                model = prepare("qwen2_5_vl", False, False, balance, VisionCost(1.0, 0.05))
            install_packed_inputs(model)
            runs[balance] = train(model, make, replicated=variant == "text" and not balance)
        (ref_losses, ref_weights, _), (losses, weights, routes) = runs[False], runs[True]
        rel = max(float((weights[k] - w).abs().max()) / (float(w.abs().max()) or 1.0) for k, w in ref_weights.items())
        first = make(dist.get_rank(), 0)
        results[variant] = {
            "reference_losses": ref_losses,
            "losses": losses,
            "weight_rel_error": rel,
            "routes": routes,
            "images": int(first["image_grid_thw"].shape[0]) if "image_grid_thw" in first else 0,
            "samples": int((first["position_ids"] == 0).sum()),
        }
    scenario_kit.write_result(outdir, "packed", results)


@scenario
def exactness(outdir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=240))  # a rank left waiting fails, not hangs
    if dist.get_world_size() == 2:
        packed_cases(outdir)
    results: dict[str, Any] = {}
    for family, recompute, freeze, cost in CASES:
        name = f"{family}{'-recompute' if recompute else ''}{'-frozen' if freeze else ''}"
        name += "-calibrated" if cost is None else ""
        runs = {}
        for balance in (False, True):
            torch.manual_seed(0)
            runs[balance] = train(prepare(family, recompute, freeze, balance, cost))
        (ref_losses, ref_weights, _), (losses, weights, routes) = runs[False], runs[True]
        rel = 0.0
        moved = 0.0
        for key, ref in ref_weights.items():
            scale = float(ref.abs().max()) or 1.0
            rel = max(rel, float((weights[key] - ref).abs().max()) / scale)
            moved = max(moved, float((ref - _initial(family, key)).abs().max()))
        results[name] = {
            "reference_losses": ref_losses,
            "losses": losses,
            "weight_rel_error": rel,
            "weights_moved": moved,
            "routes": routes,
        }
    scenario_kit.write_result(outdir, "exactness", results)
    empty_share(outdir)
    world = dist.get_world_size()
    cp = 2 if world == 4 else 1
    fits = {balance: fit_with_strategy(outdir, balance, cp) for balance in (False, True)}
    ref, got = fits[False].pop("weights"), fits[True].pop("weights")
    rel = max(float((got[k] - w).abs().max()) / (float(w.abs().max()) or 1.0) for k, w in ref.items())
    result = {"cp": cp, "weight_rel_error": rel, "unbalanced": fits[False], "balanced": fits[True]}
    scenario_kit.write_result(outdir, "strategy", result)


_INITIAL: dict[str, dict[str, torch.Tensor]] = {}


def _initial(family: str, key: str) -> torch.Tensor:
    if family not in _INITIAL:
        _INITIAL[family] = {k: v.detach().clone() for k, v in build(family).named_parameters()}
    return _INITIAL[family][key]


def empty_share(outdir: Path) -> None:
    """A direct tower call with no images on the last rank: every rank still calls the tower once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tower_ref = build("qwen3_vl").model.visual
    tower = build("qwen3_vl").model.visual
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(tower, mesh=mesh)
    enable_vision_balance(tower, VisionCost(), 1)
    g = torch.Generator().manual_seed(rank)
    grids = [(1, 2, 2)] if rank < world - 1 else []
    x = torch.randn(4 * len(grids), PATCH, generator=g)
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    out = tower(x, grid_thw=grid)
    features = [out.pooler_output, *out.deepstack_features]
    sum(f.square().sum() for f in features).backward()
    result: dict[str, Any] = {"rows": int(out.pooler_output.shape[0])}
    if grids:
        ref = tower_ref(x, grid_thw=grid)
        expected = [ref.pooler_output, *ref.deepstack_features]
        result["feature_error"] = max(float((a - b).abs().max()) for a, b in zip(features, expected))
        sum(f.square().sum() for f in expected).backward()
    # the balanced tower's gradients are the sum over ranks (FSDP2 averages: times world); the reference's local
    ref_grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in tower_ref.named_parameters()}
    for grad in ref_grads.values():
        dist.all_reduce(grad)
    errors = []
    for k, p in tower.named_parameters():
        grad = _full(p.grad) * world
        errors.append(float((grad - ref_grads[k]).abs().max()) / (float(ref_grads[k].abs().max()) or 1.0))
    result["grad_rel_error"] = max(errors)
    scenario_kit.write_result(outdir, "empty_share", result)


class _PerRankBatches(torch.utils.data.Dataset):
    """Item ``i``: the batch of rank ``i % ranks`` at step ``i // ranks`` (already collated: ``batch_size=None``)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks

    def __len__(self) -> int:
        return self.ranks * STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return batch(i % self.ranks, i // self.ranks)


def fit_with_strategy(outdir: Path, balance: bool, cp: int) -> dict[str, Any]:
    """``MMFSDP2Strategy`` with ``encoder_dp_balance`` from the YAML keys (Qwen2.5-VL loaded from a saved
    checkpoint), under ``cp``-way context parallelism: the tower runs on whole sequences, outside the split."""
    import lightning as L

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    ckpt = outdir / "qwen2_5_vl"
    if dist.get_rank() == 0 and not ckpt.exists():
        build("qwen2_5_vl").save_pretrained(ckpt)
    dist.barrier()

    class Module(MMLightningModule):
        def model_provider(self) -> nn.Module:
            return TransformersModel({"init_from_hf_path": str(ckpt)})

        def configure_optimizers(self) -> Any:  # SGD: Adam's first step is sign(g), noise where g is ~0
            return torch.optim.SGD(self.parameters(), lr=0.5)

    losses: list[float] = []

    class Observe(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            losses.append(float((outputs["loss"] if isinstance(outputs, dict) else outputs).detach()))

    keys: dict[str, Any] = {"sharding_size": "auto"}
    if balance:
        keys.update(encoder_dp_balance=True, encoder_dp_balance_cost=[1.0, 0.05])
    module = Module(lr=1e-2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy(keys, context_parallel_size=cp),
        callbacks=[Observe()],
    )
    loader = torch.utils.data.DataLoader(_PerRankBatches(dist.get_world_size() // cp), batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    model: Any = module.model
    state = balance_state(model.model.visual)
    weights = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "weights": weights,
        "balanced": state is not None and state.calls == STEPS,
        "moved": state is not None
        and state.last_route is not None
        and state.last_route.encoders != state.last_route.owners,
    }


if __name__ == "__main__":
    scenario_kit.main()
