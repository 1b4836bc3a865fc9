"""The strategy's side of the expert-parallel tests: every case on 4 ranks, in one launch.

    python tests/scenarios/ep_scenarios.py train OUTDIR --arg ckptdir=CKPTDIR     (tests/helpers/scenario_kit.py)

Each case of :data:`EP_CASES` trains a tiny Qwen3-MoE or Qwen3-VL-MoE (``tests/helpers/moe_models.py``) through
``TransformersModel`` with ``Trainer(accelerator="cpu", devices=4)`` (real gloo collectives) and records, per rank
and micro-batch, its loss and its samples (``tests/scenarios/parity_scenarios.py`` does the training and the recording);
``tests/test_expert_parallel.py`` compares them with a one-process Transformers reference. The resume chain
(:data:`CHAIN_STAGES`) trains one run in stages, each resuming the previous stage's checkpoint. Nothing is mocked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.moe_models import MOE_MODULES, register_moe_families  # noqa: E402
from tests.helpers.parity import Case  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

DEVICES = 4
STEPS = 4


def _ep(family: str, size: int, reshard: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "expert_parallel_size": size,
        "moe_modules": [MOE_MODULES[family]],
        "reshard_local_experts": reshard,
        **extra,
    }


EP_CASES = [
    Case("qwen3_moe-align", "qwen3_moe", {"align_fsdp_param_groups": True}, steps=STEPS),
    Case("qwen3_moe-ep2", "qwen3_moe", _ep("qwen3_moe", 2), steps=STEPS),
    Case("qwen3_moe-ep2-whole", "qwen3_moe", _ep("qwen3_moe", 2, False), steps=STEPS),
    Case("qwen3_moe-ep4", "qwen3_moe", _ep("qwen3_moe", 4), steps=STEPS),
    Case("qwen3_moe-ep4-whole", "qwen3_moe", _ep("qwen3_moe", 4, False), steps=STEPS),
    Case("qwen3_vl_moe-ep2", "qwen3_vl_moe", _ep("qwen3_vl_moe", 2), steps=STEPS),
    Case(
        "qwen3_vl_moe-ep4-whole-align",
        "qwen3_vl_moe",
        _ep("qwen3_vl_moe", 4, False, align_fsdp_param_groups=True),
        steps=STEPS,
    ),
    # Norm clipping that acts on every step: the norm must sum the experts of every rank of an EP group.
    Case("qwen3_moe-ep2-clip", "qwen3_moe", _ep("qwen3_moe", 2), steps=STEPS, clip=0.05),
    Case("qwen3_moe-ep4-whole-clip", "qwen3_moe", _ep("qwen3_moe", 4, False), steps=STEPS, clip=0.05),
]

CHAIN = Case("qwen3_moe-resume-chain", "qwen3_moe", steps=8)
"""One training run of :data:`CHAIN_STAGES`: each stage resumes the previous stage's checkpoint (model and AdamW
state, strictly) with other expert-parallel settings, trains, and saves its own checkpoint."""

CHAIN_STAGES: list[tuple[str, dict[str, Any], int, str]] = [
    # (label, FSDP2 keys, optimizer steps done at the end of the stage, format of the checkpoint it saves)
    ("none", {}, 2, "torch_dcp"),
    ("ep2", _ep("qwen3_moe", 2), 3, "torch_dcp"),  # no EP -> EP 2 (its checkpoint: converted to HF's layout)
    ("ep4", _ep("qwen3_moe", 4), 4, "torch_dcp"),  # EP 2 -> EP 4
    ("ep2-whole", _ep("qwen3_moe", 2, False), 5, "torch"),  # EP 4 -> EP 2 whole; saves one gathered file
    ("ep2-offload", _ep("qwen3_moe", 2, offload_to_cpu=True), 6, "torch"),  # the file -> EP 2 sharded, offloaded
    ("ep2-whole-offload", _ep("qwen3_moe", 2, False, offload_to_cpu=True), 7, "torch_dcp"),  # a file -> whole
    ("none", {}, 8, "torch"),  # EP 2 -> no EP; the final weights are compared from its gathered file
]
"""Stage ``i`` trains up to its step count; its checkpoint is ``CHAIN.name.{i}.ckpt``."""


def _ep_cp_cases() -> list[Any]:
    from tests.scenarios.cp_scenarios import CPCase

    return [  # 2 data parallel x 2 context parallel; the EP groups cut across the context-parallel pairs at EP 4
        CPCase("qwen3_moe-ep2xcp2-len15", "qwen3_moe", 15, cp=2, fsdp2=_ep("qwen3_moe", 2), steps=3),
        CPCase("qwen3_moe-ep4-whole-xcp2-len16", "qwen3_moe", 16, cp=2, fsdp2=_ep("qwen3_moe", 4, False), steps=3),
    ]


EP_CP_CASES = _ep_cp_cases()
"""Expert parallelism together with context parallelism (``MMFSDP2Strategy(context_parallel_size=2)``), run with
``tests/scenarios/cp_scenarios.py``'s harness and checked like its cases (losses, first-step gradients)."""


@scenario
def train(outdir: Path, ckptdir: str) -> None:
    ckptdir = Path(ckptdir)
    register_moe_families()
    from tests.scenarios.parity_scenarios import _finish, _fit, _guarded

    only = os.environ.get("EP_ONLY")
    for case in EP_CASES:
        if only and case.name not in only.split(","):
            continue

        def run(case: Case = case) -> None:
            record, (trainer, module) = _fit(case, ckptdir, outdir, case.steps, devices=DEVICES)
            record["aligned"] = _aligned_unit(trainer, module)
            _finish(case, outdir, [record], trainer, module)

        _guarded(case, outdir, run)
    for cp_case in EP_CP_CASES:
        if not only or cp_case.name in only.split(","):
            _guarded(cp_case, outdir, lambda c=cp_case: _ep_cp(c, outdir, ckptdir))
    if not only or CHAIN.name in only.split(","):
        _chain(outdir, ckptdir)
    if not only or IDLE_RANK.name in only.split(","):
        _guarded(IDLE_RANK, outdir, lambda: _idle_rank(outdir))
    # After the above (tests/scenarios/ep_custom_scenarios.py): a custom model's dispatch hook, training with idle EP
    # ranks, per-expert (Hub layout) checkpoints loaded sliced, and the routed forward over each Transformers experts
    # kernel.
    from tests.scenarios.ep_custom_scenarios import run_cases

    run_cases(outdir, set(only.split(",")) if only else None)


def _ep_cp(case: Any, outdir: Path, ckptdir: Path) -> None:
    from tests.scenarios.cp_scenarios import _finish, _fit

    record, (trainer, module) = _fit(case, case.cp, ckptdir, outdir, case.steps, DEVICES)
    _finish(case, outdir, [record], trainer, module)


IDLE_RANK = Case("qwen3_moe-ep4-idle-rank", "qwen3_moe")
"""The routed forward and backward on 4 ranks (EP 4) with a routing that sends no token to the last rank's
experts, against the unsplit experts module. Run after the training cases (their Trainer set up the gloo group)."""


def _idle_rank(outdir: Path) -> None:
    """A rank whose local experts receive no token must still take part in the all-to-alls' backward.

    It used to skip the dispatching all-to-all's backward (its output did not depend on the received tokens), so
    its next collective met the other ranks' all-to-all: a deadlock (in training, FSDP's reduce-scatter against
    the all-to-all). Here that next collective is an all-reduce of the gradients; the launch times out without the
    fix. Outputs and gradients must equal the unsplit module's (to fp32 rounding).
    """
    import torch.distributed as dist

    from lightning_mm.core.expert_parallel import ExpertGroup, routed_forward, split_experts
    from tests.helpers.moe_models import tiny_moe_model
    from tests.scenarios.parity_scenarios import _dump

    assert dist.is_initialized() and dist.get_world_size() == DEVICES
    rank = dist.get_rank()
    experts = []
    for _ in range(2):  # the unsplit module and the one to split, same weights
        model = tiny_moe_model("qwen3_moe")
        # Transformers' eager loop returns a fresh `zeros_like` when no token came (the output loses the tokens)
        model.set_experts_implementation("eager")
        experts.append(model.model.layers[0].mlp.experts)
    full, local = experts
    num = full.num_experts
    ep = ExpertGroup(dist.group.WORLD, rank, DEVICES, num)
    split_experts(local, "experts", ep)
    forward = routed_forward(local, local.forward, ep)
    gen = torch.Generator().manual_seed(rank)
    tokens, k = 6, 2
    hidden = torch.randn(tokens, full.hidden_dim, generator=gen)
    busy = num - ep.experts_per_rank  # the last rank's experts get no token
    index = torch.stack([torch.randperm(busy, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    results = []
    for module, run in ((full, full.forward), (local, forward)):
        x = hidden.clone().requires_grad_(True)
        w = weights.clone().requires_grad_(True)
        out = run(x, index, w)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = [p.grad.clone() for p in module.parameters()]
        results.append((out.detach(), x.grad, w.grad, grads))
    # the local experts' gradients summed over the EP ranks' tokens, scaled by 1/ep: times ep, as a full module's
    local_grads = [g * DEVICES for g in results[1][3]]
    full_grads = [g.clone() for g in results[0][3]]  # summed over the ranks: every token's contribution
    for g in full_grads:  # the next collective: pairs with the others' all-to-all if this rank skipped one
        dist.all_reduce(g)
    summed = torch.cat([g[ep.first_expert : ep.first_expert + ep.experts_per_rank].reshape(-1) for g in full_grads])
    local_flat = torch.cat([g.reshape(-1) for g in local_grads])
    (expected_out, expected_x, expected_w, _), (out, x_grad, w_grad, _) = results
    diff = lambda a, b: float((a - b).abs().max()) if a.numel() else 0.0  # noqa: E731
    _dump(
        IDLE_RANK,
        outdir,
        rank,
        {
            "error": None,
            "parts": [
                {
                    "out": diff(out, expected_out),
                    "x_grad": diff(x_grad, expected_x),
                    "w_grad": diff(w_grad, expected_w),
                    "expert_grads": diff(local_flat, summed) / max(float(summed.abs().max()), 1e-30),
                    "idle_expert_grads": max(float(g.abs().max()) for g in results[1][3])
                    if rank == DEVICES - 1
                    else None,
                }
            ],
        },
    )


def chain_checkpoint(outdir: Path, stage: int) -> Path:
    return outdir / f"{CHAIN.name}.{stage}.ckpt"


def _chain(outdir: Path, ckptdir: Path) -> None:
    """Every stage of :data:`CHAIN_STAGES`, each resuming the last one's checkpoint. Each rank records the stages
    it finished (``parts``) and, if one failed, which one and why; the stages after a failed one do not run."""
    import traceback

    import torch.distributed as dist

    from tests.scenarios.parity_scenarios import _dump, _fit

    parts: list[dict[str, Any]] = []
    error = None
    try:
        for i, (label, fsdp2, steps, fmt) in enumerate(CHAIN_STAGES):
            stage = Case(f"{CHAIN.name}.{i}-{label}", CHAIN.family, fsdp2, steps=steps)
            resume = str(chain_checkpoint(outdir, i - 1)) if i else None
            record, (trainer, module) = _fit(stage, ckptdir, outdir, steps, devices=DEVICES, ckpt_path=resume)
            record["experts"] = _expert_units(module)
            trainer.strategy.checkpoint_format = fmt
            trainer.save_checkpoint(chain_checkpoint(outdir, i))
            parts.append(record)
    except Exception:  # recorded for the tests; the later stages cannot run without this stage's checkpoint
        error = f"stage {len(parts)} {CHAIN_STAGES[len(parts)][0]}:\n{traceback.format_exc()[-4000:]}"
    _dump(CHAIN, outdir, dist.get_rank() if dist.is_initialized() else 0, {"parts": parts, "error": error})


def _expert_units(module: Any) -> list[dict[str, Any]]:
    """Per MoE module: the size of the mesh FSDP shards it over and its offload policy (None when not in FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for path in [f"model.layers.{i}.mlp.experts" for i in range(2)]:  # Qwen3-MoE's (CHAIN.family)
        experts = module.model.get_submodule(path)
        if not isinstance(experts, FSDPModule):
            out.append({"fsdp_mesh": None, "offload": None, "device": str(next(experts.parameters()).device)})
            continue
        group = experts._get_fsdp_state()._fsdp_param_group
        out.append(
            {
                "fsdp_mesh": group.mesh_info.mesh.size(),
                "offload": type(group.offload_policy).__name__,
                "device": str(group.fsdp_params[0].sharded_param.device),
            }
        )
    return out


def _aligned_unit(trainer: Any, module: Any) -> list[str] | None:
    """The parameter names FSDP manages in the aligned unit (the unit whose first module is a norm or router)."""
    plan = trainer.strategy.plan
    labelled = [u for u in plan.units if u.label]
    if not labelled:
        return None
    model = module.model
    first = model.get_submodule(labelled[0].modules[0])
    state = first._get_fsdp_state()
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names[id(fp.sharded_param)] for group in [state._fsdp_param_group] for fp in group.fsdp_params)


if __name__ == "__main__":
    scenario_kit.main()
