"""Combinations a checkpoint save would refuse, refused at the strategy's setup, before the first step:
``python tests/scenarios/setup_refusal_scenarios.py refusals WORKDIR`` (tests/helpers/scenario_kit.py).

Real 2-rank Lightning fits on CPU (gloo), one after the other in one launch, each with a ``ModelCheckpoint`` that
saves after every step and a callback counting the training batches that started: ``checkpoint_format="hf"`` with a
LoRA model (a tiny Qwen3 with PEFT adapters), ``"hf"`` and ``"torch"`` at a URL ``dirpath`` (fsspec's
``memory://``). Every rank writes the error it got and the batches that ran to
``WORKDIR/refusals.rank{R}.json``; tests/test_setup_refusals.py asserts on it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tests.scenarios.ckpt_scenarios as base  # noqa: E402
from lightning_mm import MMFSDP2Strategy  # noqa: E402
from lightning_mm.hf.lora import apply_lora  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario, write_result  # noqa: E402
from tests.scenarios.ckpt_remote_scenarios import QWEN_FSDP, QwenModule  # noqa: E402


class LoRAQwen(QwenModule):
    """The tiny Qwen3 of tests/scenarios/ckpt_remote_scenarios.py with LoRA adapters on its query projections."""

    def model_provider(self) -> Any:
        lora = {"rank": 4, "alpha": 8, "target_modules": ["model.layers.{*}.self_attn.q_proj"]}
        return apply_lora(super().model_provider(), lora)


class Batches(L.Callback):
    """How many training batches started (0: the fit failed before its first step)."""

    def __init__(self) -> None:
        self.started = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        self.started += 1


def _fit(strategy: MMFSDP2Strategy, checkpoint: ModelCheckpoint, module: Any = None, data: Any = None) -> dict:
    batches = Batches()
    try:
        trainer, _ = base.fit(strategy, 2, callbacks=[checkpoint, batches], module=module, data=data)
    except Exception as err:  # the test expects a ValueError; anything else is reported by name
        error = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        return {"error": error, "batches": batches.started}
    return {"error": None, "batches": batches.started, "global_step": trainer.global_step}


def _every_step(dirpath: str | Path, **kwargs: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1, **kwargs)


@scenario
def refusals(work: Path, only: str = "") -> None:
    """Every case in one launch (``only``: the one named, e.g. to see what a save would do without the checks)."""
    base.use_workdir(work)
    out: dict[str, Any] = {}
    # Refused before the process group starts (the directories are known then).
    if only in ("", "hf_url"):
        out["hf_url"] = _fit(
            MMFSDP2Strategy(QWEN_FSDP, empty_init=False, checkpoint_format="hf"),
            _every_step("memory://refusals/hf"),
            QwenModule(),
            base.LlamaData(),
        )
    if only in ("", "torch_url"):
        out["torch_url"] = _fit(
            MMFSDP2Strategy(base.FSDP, checkpoint_format="torch"), _every_step("memory://refusals/pt")
        )
    # Refused once the model is built and sharded, before the first step; last: a failed run ends its process group,
    # and a later group of this process on the same rendezvous port is not reliable.
    if only in ("", "hf_lora"):
        out["hf_lora"] = _fit(
            MMFSDP2Strategy(QWEN_FSDP, empty_init=False, checkpoint_format="hf"),
            _every_step(work / "lora"),
            LoRAQwen(),
            base.LlamaData(),
        )
    out["lora_dir"] = sorted(p.name for p in (work / "lora").iterdir()) if (work / "lora").exists() else []
    write_result(work, "refusals", out, scenario_kit.current_rank())


if __name__ == "__main__":
    scenario_kit.main()
