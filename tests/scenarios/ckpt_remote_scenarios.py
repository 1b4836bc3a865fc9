"""Checkpoints at S3 URLs, and Hugging Face weights in checkpoints: ``python tests/scenarios/ckpt_remote_scenarios.py
SCENARIO WORKDIR`` (tests/helpers/scenario_kit.py).

Real 2-rank Lightning jobs on CPU (gloo) writing to and resuming from an S3 API server on localhost (started by
tests/test_checkpoint_remote.py, which writes its endpoint and the credentials to ``WORKDIR/s3.json``). The
strategy gets the credentials through ``storage_options``; Lightning's ``ModelCheckpoint`` lists its directory
through fsspec's configuration, given other (dummy) credentials here, so that the secret of ``storage_options``
can only reach the store through the strategy. Each scenario writes ``WORKDIR/SCENARIO.rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import fsspec
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tests.scenarios.ckpt_scenarios as base  # noqa: E402
from lightning_mm import MMFSDP2Strategy, MMLightningModule  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402
from tests.scenarios.ckpt_scenarios import FSDP, Recorder, dump, fit, kill_rank1_during_save  # noqa: E402

STEPS = 4


def _settings(work: Path) -> dict[str, Any]:
    settings = json.loads((work / "s3.json").read_text())
    fsspec.config.conf["s3"] = {
        "key": "lightning-fs-key",
        "secret": "lightning-fs-secret",  # ModelCheckpoint's
        "client_kwargs": {"endpoint_url": settings["endpoint"], "region_name": "eu-west-1"},
    }
    return settings


def _strategy(settings: dict[str, Any]) -> MMFSDP2Strategy:
    return MMFSDP2Strategy(FSDP, storage_options=settings["storage_options"])


def _every_two(url: str, **kwargs: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=url, filename="{step}", every_n_train_steps=2, **kwargs)


@scenario(exit_cleanly=False)
def crash(work: Path) -> None:
    """Rank 1 is killed in the middle of the 4th save (step 4's overwrite of last.ckpt)."""
    base.use_workdir(work)
    settings = _settings(work)
    kill_rank1_during_save(4)
    fit(
        _strategy(settings), STEPS, callbacks=[_every_two(f"{settings['bucket']}/crash", save_top_k=-1, save_last=True)]
    )


@scenario(exit_cleanly=False)
def main(work: Path) -> None:
    """ModelCheckpoint to S3 (all, top-1 with removals, last), exact resume from a URL, resume after the crash."""
    base.use_workdir(work)
    settings = _settings(work)
    bucket = settings["bucket"]
    out: dict[str, Any] = {}
    every = _every_two(f"{bucket}/run", save_top_k=-1, save_last=True)
    latest = _every_two(f"{bucket}/top", save_top_k=1, monitor="step", mode="max")
    t, rec = fit(
        _strategy(settings), STEPS, callbacks=[every, latest, Recorder(ref_to=work / "ref.pt", dump_at_step=STEPS)]
    )
    rank = t.global_rank
    out["uninterrupted"] = rec.losses

    _, rec = fit(
        _strategy(settings),
        STEPS,
        ckpt_path=f"{bucket}/run/step=2.ckpt",
        callbacks=[Recorder(ref_to=work / "resumed.pt", dump_at_step=STEPS)],
    )
    out["resumed_2"] = {"start": rec.start_step, "losses": rec.losses}

    # After the crash: last.ckpt is the step-2 one; the resumed run's first save removes the crash's staging.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, rec = fit(
            _strategy(settings),
            4,
            ckpt_path=f"{bucket}/crash/last.ckpt",
            callbacks=[_every_two(f"{bucket}/crash", save_top_k=-1, save_last=True)],
        )
    out["resumed_last_after_crash"] = {"start": rec.start_step, "losses": rec.losses}

    dump("main", work, rank, out)


# ------------------------------------------------------------------------------------ Hugging Face weights
QWEN_FSDP = {"sharding_size": "auto", "sub_modules_to_wrap": ["model.layers.{*}"]}


def tiny_qwen3_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )


class QwenModule(MMLightningModule):
    def __init__(self) -> None:
        super().__init__(lr=1e-2)

    def model_provider(self) -> Any:
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(7)
        return Qwen3ForCausalLM(tiny_qwen3_config())


def _qwen(
    steps: int, fmt: str, ckpt_path: str | None = None, callbacks: list | None = None, **kwargs: Any
) -> tuple[Any, Any]:
    strategy = MMFSDP2Strategy(QWEN_FSDP, empty_init=False, checkpoint_format=fmt, **kwargs)
    return fit(strategy, steps, ckpt_path=ckpt_path, callbacks=callbacks, module=QwenModule(), data=base.LlamaData())


@scenario(exit_cleanly=False)
def hf(work: Path) -> None:
    """checkpoint_format="hf" (ModelCheckpoint), a weights-only resume from it; "torch_dcp+hf" in bf16, an exact
    resume from its DCP part."""
    base.use_workdir(work)
    out: dict[str, Any] = {}
    t, _ = _qwen(
        2,
        "hf",
        callbacks=[
            ModelCheckpoint(dirpath=work / "hf", filename="{step}", every_n_train_steps=2, save_top_k=-1),
            Recorder(ref_to=work / "hf_ref.pt", dump_at_step=2),
        ],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t, rec = _qwen(
            3,
            "torch_dcp+hf",
            ckpt_path=str(work / "hf" / "step=2.ckpt"),
            save_ckpt_dtype="bf16",
            callbacks=[Recorder(dump_to=work / "hf_loaded.pt", ref_to=work / "both_ref.pt", dump_at_step=3)],
        )
    out["weights_only"] = {
        "start": rec.start_step,
        "warnings": [str(w.message) for w in caught if "weights only" in str(w.message)],
    }
    t.save_checkpoint(work / "both.ckpt")
    _, rec = _qwen(
        4, "torch_dcp+hf", ckpt_path=str(work / "both.ckpt"), callbacks=[Recorder(dump_to=work / "both_loaded.pt")]
    )
    out["exact"] = {"start": rec.start_step}
    dump("hf", work, t.global_rank, out)


if __name__ == "__main__":
    scenario_kit.main()
