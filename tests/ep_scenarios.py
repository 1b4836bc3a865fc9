"""The strategy's side of the expert-parallel tests: every case on 4 ranks, in one launch.

    python tests/ep_scenarios.py GROUP OUTDIR CKPTDIR

Each case of :data:`EP_CASES` trains a tiny Qwen3-MoE or Qwen3-VL-MoE (``tests/moe_models.py``) through
``TransformersModel`` with ``Trainer(accelerator="cpu", devices=4)`` (real gloo collectives) and records, per rank
and micro-batch, its loss and its samples (``tests/parity_scenarios.py`` does the training and the recording);
``tests/test_expert_parallel.py`` compares them with a one-process Transformers reference. Nothing is mocked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.moe_models import MOE_MODULES, register_moe_families  # noqa: E402
from tests.parity import Case  # noqa: E402

DEVICES = 4
STEPS = 4


def _ep(family: str, size: int, reshard: bool = True, **extra: Any) -> dict[str, Any]:
    return {"expert_parallel_size": size, "moe_modules": [MOE_MODULES[family]], "reshard_local_experts": reshard,
            **extra}


EP_CASES = [
    Case("qwen3_moe-align", "qwen3_moe", {"align_fsdp_param_groups": True}, steps=STEPS),
    Case("qwen3_moe-ep2", "qwen3_moe", _ep("qwen3_moe", 2), steps=STEPS),
    Case("qwen3_moe-ep2-whole", "qwen3_moe", _ep("qwen3_moe", 2, False), steps=STEPS),
    Case("qwen3_moe-ep4", "qwen3_moe", _ep("qwen3_moe", 4), steps=STEPS),
    Case("qwen3_moe-ep4-whole", "qwen3_moe", _ep("qwen3_moe", 4, False), steps=STEPS),
    Case("qwen3_vl_moe-ep2", "qwen3_vl_moe", _ep("qwen3_vl_moe", 2), steps=STEPS),
    Case("qwen3_vl_moe-ep4-whole-align", "qwen3_vl_moe", _ep("qwen3_vl_moe", 4, False, align_fsdp_param_groups=True),
         steps=STEPS),
]

RESUME = Case("qwen3_moe-resume-ep2-to-none", "qwen3_moe", _ep("qwen3_moe", 2), steps=6, resume_at=3)
"""Trained with EP 2 for 3 steps and saved; resumed without expert parallelism for the other 3."""


def group_train(outdir: Path, ckptdir: Path) -> None:
    from tests.parity_scenarios import _finish, _fit, _guarded

    only = os.environ.get("EP_ONLY")
    for case in EP_CASES:
        if only and case.name not in only.split(","):
            continue
        def run(case: Case = case) -> None:
            record, (trainer, module) = _fit(case, ckptdir, outdir, case.steps, devices=DEVICES)
            record["aligned"] = _aligned_unit(trainer, module)
            _finish(case, outdir, [record], trainer, module)

        _guarded(case, outdir, run)
    if not only or RESUME.name in only.split(","):
        _guarded(RESUME, outdir, lambda: _resume(outdir, ckptdir))


def _resume(outdir: Path, ckptdir: Path) -> None:
    from tests.parity_scenarios import _finish, _fit

    assert RESUME.resume_at is not None
    first, (trainer, _) = _fit(RESUME, ckptdir, outdir, RESUME.resume_at, devices=DEVICES)
    path = outdir / f"{RESUME.name}.ckpt"
    trainer.save_checkpoint(path)
    plain = Case(RESUME.name, RESUME.family, {}, steps=RESUME.steps)
    second, (trainer, module) = _fit(plain, ckptdir, outdir, RESUME.steps, devices=DEVICES, ckpt_path=str(path))
    _finish(RESUME, outdir, [first, second], trainer, module)


def _aligned_unit(trainer: Any, module: Any) -> list[str] | None:
    """The parameter names FSDP manages in the aligned unit (the unit whose first module is a norm or router)."""
    plan = trainer.strategy._plan
    labelled = [u for u in plan.units if u.label]
    if not labelled:
        return None
    model = module.model
    first = model.get_submodule(labelled[0].modules[0])
    state = first._get_fsdp_state()
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names[id(fp.sharded_param)] for group in [state._fsdp_param_group] for fp in group.fsdp_params)


if __name__ == "__main__":
    torch.set_num_threads(1)
    register_moe_families()
    name, out, ckpts = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    globals()[f"group_{name}"](out, ckpts)
    from tests.scenario_exit import exit_cleanly

    exit_cleanly()
