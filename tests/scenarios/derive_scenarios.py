"""The strategy's side of the derived-plan parity run (``tests/test_derived_plan.py``), on 2 ranks.

    python tests/scenarios/derive_scenarios.py train OUTDIR     (tests/helpers/scenario_kit.py)

Trains each case of ``CASES`` one after the other with the parity harness of ``tests/scenarios/parity_scenarios.py``:
``TransformersModel`` from ``OUTDIR/ckpts/<architecture>`` (a ``save_pretrained`` directory the pytest side
writes, read sliced per rank), with the derived default plan (these architectures have no adapter). Each rank
writes ``OUTDIR/CASE.rank{R}.json`` with its losses, sample indices and steps, and the plan it ran (units, ignored
modules, model class); a case with ``resume_at`` trains that many steps, saves a checkpoint and resumes from it in a
new Trainer (two parts). Rank 0 writes the gathered final weights to ``OUTDIR/CASE.pt``. Nothing is mocked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.derive_models import register_parity_families  # noqa: E402
from tests.helpers.parity import Case  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

_RECOMPUTE = ["model.vision_model.encoder.layers.{*}", "model.text_model.layers.{*}"]
CASES = [
    Case("derived-idefics3-plain", "idefics3", steps=3),
    Case("derived-mistral3-plain", "mistral3", steps=3),
    Case(
        "derived-idefics3-recompute-reentrant",
        "idefics3",
        {"recompute_modules": _RECOMPUTE, "use_reentrant": True},
        steps=3,
    ),
    Case("derived-mistral3-frozen-tower", "mistral3", freeze=("model.vision_tower",), steps=3),
    # Trained 2 steps, saved, resumed by a new Trainer for the third (tower trainable: its AdamW state resumes too).
    Case("derived-idefics3-resume", "idefics3", steps=3, resume_at=2),
]


LOAD_ONLY = {"gemma3": {}, "glm4v": {}, "glm4v_moe": {"expert_parallel_size": 2}, "qwen2_5_omni_thinker": {}}
"""Architectures whose ``save_pretrained`` directory each rank reads sliced (FSDP2 shards; GLM-4.5V's experts also
split over 2 EP ranks, from per-expert checkpoint tensors), checked against ``from_pretrained``."""


def sliced_load(name: str, fsdp2: dict, outdir: Path, ckptdir: Path) -> None:
    """Shard the meta-built model with its derived plan in the process group of the training cases, let each rank
    read its own slices, and compare every local tensor with the same slice of ``from_pretrained``'s."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.tensor import DTensor

    from lightning_mm._compat import local_offsets
    from lightning_mm.core.apply import apply_plan, build_device_mesh
    from lightning_mm.core.config import FSDP2Config
    from lightning_mm.core.init_context import meta_parameters
    from lightning_mm.core.sharding_plan import build_plan
    from lightning_mm.modules import TransformersModel
    from tests.helpers.derive_models import ARCHITECTURES

    rank, world = dist.get_rank(), dist.get_world_size()
    directory = ckptdir / name
    with meta_parameters():
        model = TransformersModel({"init_from_hf_path": str(directory)})
    model_class = type(model).__name__  # before fully_shard makes it FSDP<class>
    config = FSDP2Config.from_dict({"sharding_size": "auto", **fsdp2}).with_model_defaults(model)
    plan = build_plan(config, model, world)
    apply_plan(model, model, plan, build_device_mesh(world, world, "cpu"), torch.device("cpu"))
    ref = dict(
        getattr(transformers, ARCHITECTURES[name][0])
        .from_pretrained(str(directory), dtype=torch.float32)
        .named_parameters()
    )
    experts = plan.experts.moe_modules if plan.experts is not None else ()
    wrong, sharded, split_experts = [], 0, 0
    for key, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param.detach()
        expected = ref[key]
        if any(key.startswith(m + ".") for m in experts):  # this rank's experts of its EP group
            per_rank = plan.experts.experts_per_rank
            expected = expected[rank % plan.experts.expert_parallel_size * per_rank :][:per_rank]
            split_experts += 1
        if isinstance(param, DTensor):
            offsets, shape = local_offsets(param)
            for dim, (start, size) in enumerate(zip(offsets, shape)):
                expected = expected.narrow(dim, start, size)
            sharded += local.numel() < param.numel()
        if local.shape != expected.shape or not torch.equal(local, expected):
            wrong.append(key)
    (outdir / f"load-{name}.rank{rank}.json").write_text(
        json.dumps(
            {
                "wrong": wrong,
                "sharded": sharded,
                "split_experts": split_experts,
                "params": len(ref),
                "model_class": model_class,
            }
        )
    )


@scenario
def train(outdir: Path) -> None:
    from tests.scenarios import parity_scenarios as ps

    ckptdir = outdir / "ckpts"

    register_parity_families()
    for case in CASES:

        def run(case: Case = case) -> None:
            parts = []
            if case.resume_at is not None:  # as tests/scenarios/parity_scenarios.py's `resume` group does
                first, (trainer, _) = ps._fit(case, ckptdir, outdir, case.resume_at)
                trainer.save_checkpoint(outdir / f"{case.name}.ckpt")
                parts.append(first)
            resume = str(outdir / f"{case.name}.ckpt") if parts else None
            record, (trainer, module) = ps._fit(case, ckptdir, outdir, case.steps, ckpt_path=resume)
            plan = trainer.strategy.plan
            record["plan"] = {
                "units": [list(u.modules) for u in plan.units],
                "ignored": list(plan.ignored_modules),
                "recompute": list(plan.recompute_modules),
                "model_class": type(module.model).__name__,
            }
            ps._finish(case, outdir, [*parts, record], trainer, module)

        ps._guarded(case, outdir, run)
    for name, fsdp2 in LOAD_ONLY.items():
        sliced_load(name, fsdp2, outdir, ckptdir)


if __name__ == "__main__":
    scenario_kit.main()
