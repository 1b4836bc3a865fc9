"""The strategy's side of the derived-plan parity run (``tests/test_derived_plan.py``), on 2 ranks.

    python tests/derive_scenarios.py train OUTDIR

Trains each case of ``CASES`` one after the other with the parity harness of ``tests/parity_scenarios.py``:
``TransformersModel`` from ``OUTDIR/ckpts/<architecture>`` (a ``save_pretrained`` directory the pytest side
writes, read sliced per rank), with the derived default plan (these architectures have no adapter). Each rank
writes ``OUTDIR/CASE.rank{R}.json`` with its losses, sample indices and steps, and the plan it ran (units, ignored
modules, model class); rank 0 writes the gathered final weights to ``OUTDIR/CASE.pt``. Nothing is mocked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.derive_models import register_parity_families  # noqa: E402
from tests.parity import Case  # noqa: E402

_RECOMPUTE = ["model.vision_model.encoder.layers.{*}", "model.text_model.layers.{*}"]
CASES = [
    Case("derived-idefics3-plain", "idefics3", steps=3),
    Case("derived-mistral3-plain", "mistral3", steps=3),
    Case("derived-idefics3-recompute-reentrant", "idefics3", {"recompute_modules": _RECOMPUTE, "use_reentrant": True},
         steps=3),
    Case("derived-mistral3-frozen-tower", "mistral3", freeze=("model.vision_tower",), steps=3),
]


def main(outdir: Path, ckptdir: Path) -> None:
    from tests import parity_scenarios as ps

    register_parity_families()
    for case in CASES:
        def run(case: Case = case) -> None:
            record, (trainer, module) = ps._fit(case, ckptdir, outdir, case.steps)
            plan = trainer.strategy.plan
            record["plan"] = {"units": [list(u.modules) for u in plan.units], "ignored": list(plan.ignored),
                              "recompute": list(plan.recompute), "model_class": type(module.model).__name__}
            ps._finish(case, outdir, [record], trainer, module)

        ps._guarded(case, outdir, run)


if __name__ == "__main__":
    torch.set_num_threads(1)
    assert sys.argv[1] == "train", sys.argv[1]
    main(Path(sys.argv[2]), Path(sys.argv[2]) / "ckpts")
    from tests.scenario_exit import exit_cleanly

    exit_cleanly()
