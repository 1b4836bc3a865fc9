"""Checkpoint scenarios: ``python tests/scenarios/ckpt_scenarios.py SCENARIO WORKDIR`` (tests/helpers/scenario_kit.py).

Run as real Lightning jobs on CPU (gloo, explicit CPU mesh) in a fresh process, on 1 or 2 ranks (Lightning's
launcher re-runs this script for rank 1). Each writes ``WORKDIR/SCENARIO.rank{R}.json`` and, for state
comparisons, full (gathered) model and optimiser states as ``.pt`` files; tests/test_checkpoint_dist.py asserts on
them. Nothing is mocked; the crash scenario kills rank 1 with SIGKILL in the middle of a real save.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMFSDP2Strategy, MMLightningModule  # noqa: E402
from lightning_mm.datamodules.resumable import ResumableDataLoader  # noqa: E402
from lightning_mm.modules import FSDP2Mixin, MultiModalModule, WeightInitMixin  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario, write_result  # noqa: E402

FSDP = {"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}", "head"]}
LAYERS_ONLY = {"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}
HSDP = {"sharding_size": 1, "sub_modules_to_wrap": ["layers.{*}", "head"]}
STEPS = 12  # two epochs of 6 batches per rank on 2 ranks
WORK = Path(".")


# ----------------------------------------------------------------------------------------- model
class DropNet(MultiModalModule, FSDP2Mixin, WeightInitMixin):
    """Dropout, Python and NumPy randomness in the loss: a resume is exact only if every RNG is restored."""

    def __init__(self, extra_head: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 32)])
        self.drop = nn.Dropout(0.2)
        if extra_head:
            self.out = nn.Linear(32, 1)  # a renamed head: a strict load must refuse the checkpoint
        else:
            self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        head = self.out if hasattr(self, "out") else self.head
        noise = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
        return F.mse_loss(head(x), y) * noise


class Net(MMLightningModule):
    def __init__(self, extra_head: bool = False) -> None:
        super().__init__(lr=0.02, warmup_steps=2, lr_decay_style="cosine", min_lr=0.001)
        self.extra_head = extra_head

    def model_provider(self) -> nn.Module:
        return DropNet(self.extra_head)


class Regression(Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(123)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class Data(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(Regression(), batch_size=4, shuffle=True)  # MMDataModule's stateful loader


# ------------------------------------------------------------------------------------- helpers
class Recorder(L.Callback):
    """Per-batch losses; the global step and the full state right after a restore (at train start)."""

    def __init__(self, dump_to: Path | None = None, dump_at_step: int | None = None, ref_to: Path | None = None):
        self.losses: list[float] = []
        self.start_step: int | None = None
        self.dump_to, self.dump_at_step, self.ref_to = dump_to, dump_at_step, ref_to

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.start_step = trainer.global_step
        if self.dump_to is not None:
            dump_state(pl_module, trainer, self.dump_to)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach()))
        if self.ref_to is not None and trainer.global_step == self.dump_at_step:
            dump_state(pl_module, trainer, self.ref_to)


def dump_state(module: nn.Module, trainer: L.Trainer, path: Path) -> None:
    """Gathered model and optimiser state (collective: every rank calls it; rank 0 writes)."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(module, options=full)
    optims = [get_optimizer_state_dict(module, o, options=full) for o in trainer.optimizers]
    if trainer.global_rank == 0:
        torch.save({"model": model, "optimizers": optims, "global_step": trainer.global_step}, path)


def trainer(strategy: Any, max_steps: int, devices: int = 2, **kwargs: Any) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_checkpointing=False,
    )
    defaults.update(kwargs)
    defaults["default_root_dir"] = WORK
    if kwargs.get("callbacks") and any(isinstance(c, ModelCheckpoint) for c in kwargs["callbacks"]):
        defaults["enable_checkpointing"] = True
    return L.Trainer(strategy=strategy, **defaults)


def fit(
    strategy: Any,
    max_steps: int,
    ckpt_path: str | None = None,
    callbacks: list | None = None,
    devices: int = 2,
    module: L.LightningModule | None = None,
    data: Any = None,
) -> tuple[L.Trainer, Recorder]:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    recorder = next((c for c in callbacks or [] if isinstance(c, Recorder)), None) or Recorder()
    callbacks = [c for c in callbacks or [] if c is not recorder] + [recorder]
    t = trainer(strategy, max_steps, devices=devices, callbacks=callbacks)
    t.fit(module or Net(), datamodule=data or Data(), ckpt_path=ckpt_path)
    return t, recorder


def use_workdir(work: Path) -> None:
    """The Trainers' ``default_root_dir`` from now on (also for tests/scenarios/ckpt_remote_scenarios.py)."""
    global WORK
    WORK = work


def dump(name: str, workdir: Path, rank: int, data: dict[str, Any]) -> None:
    write_result(workdir, name, data, rank)


def listing(directory: Path) -> dict[str, Any]:
    """Every entry of a checkpoint directory (hidden ones included) with what it is."""
    out = {}
    for p in sorted(directory.iterdir()):
        out[p.name] = {
            "link": os.readlink(p) if p.is_symlink() else None,
            "complete": (p / ".metadata").is_file() and (p / "meta.pt").is_file() if p.is_dir() else p.is_file(),
        }
    return out


def kill_rank1_during_save(number: int) -> None:
    """SIGKILL rank 1 right after it wrote its shard file of the ``number``-th DCP save (before the save ends)."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data
    count = {"n": 0}

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        future = original(self, plan, planner)
        count["n"] += 1
        if count["n"] == number and int(os.environ.get("LOCAL_RANK", "0")) == 1:
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_data


# ----------------------------------------------------------------------------------- scenarios
@scenario(exit_cleanly=False)
def one_rank(work: Path) -> None:
    """1 rank: a checkpoint to reshard onto 2 ranks; strict refusal and non-strict report through trainer.fit."""
    use_workdir(work)
    t, rec = fit(
        MMFSDP2Strategy(FSDP), max_steps=3, devices=1, callbacks=[Recorder(ref_to=work / "ref_one.pt", dump_at_step=3)]
    )
    t.save_checkpoint(work / "one.ckpt")
    result: dict[str, Any] = {"losses": rec.losses}

    try:
        fit(
            MMFSDP2Strategy(LAYERS_ONLY),
            max_steps=4,
            devices=1,
            module=Net(extra_head=True),
            ckpt_path=str(work / "one.ckpt"),
        )
        result["strict_error"] = None
    except Exception as error:  # the message is what the test checks
        result["strict_error"] = f"{type(error).__name__}: {error}"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = Net(extra_head=True)
        t, rec = fit(
            MMFSDP2Strategy(LAYERS_ONLY, strict_loading=False),
            max_steps=4,
            devices=1,
            module=module,
            ckpt_path=str(work / "one.ckpt"),
            callbacks=[Recorder(dump_to=work / "nonstrict.pt")],
        )
    result["nonstrict_warnings"] = [str(w.message) for w in caught if "Non-strict" in str(w.message)]
    result["nonstrict_start_step"] = rec.start_step
    dump("one_rank", work, 0, result)


@scenario(exit_cleanly=False)
def crash(work: Path) -> None:
    """Rank 1 is killed in the middle of the 4th save (step 4's overwrite of last.ckpt)."""
    use_workdir(work)
    kill_rank1_during_save(4)
    ckpt = ModelCheckpoint(
        dirpath=work / "crash", filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    fit(MMFSDP2Strategy(FSDP), max_steps=STEPS, callbacks=[ckpt])


@scenario(exit_cleanly=False)
def main(work: Path) -> None:
    """Everything else on 2 ranks, one launch: exact resume, ModelCheckpoint features, resharding, torch format."""
    use_workdir(work)
    out: dict[str, Any] = {}
    # 1. Uninterrupted run with two ModelCheckpoints; the full state at step 6 is the reference for resharding.
    every3 = ModelCheckpoint(
        dirpath=work / "all", filename="{step}", every_n_train_steps=3, save_top_k=-1, save_last=True
    )
    best = ModelCheckpoint(
        dirpath=work / "best",
        filename="best-{step}",
        monitor="train/loss",
        mode="min",
        save_top_k=2,
        every_n_train_steps=2,
        save_last="link",
    )
    t, rec = fit(
        MMFSDP2Strategy(FSDP), STEPS, callbacks=[every3, best, Recorder(ref_to=work / "ref6.pt", dump_at_step=6)]
    )
    rank = t.global_rank
    out["uninterrupted"] = rec.losses
    out["best_k"] = sorted(Path(p).name for p in best.best_k_models)
    out["best_last_saved"] = Path(best._last_checkpoint_saved).name
    out["best_listing"] = listing(work / "best")
    out["all_listing"] = listing(work / "all")

    # 2. Exact resume, mid-epoch (step 3) and at the epoch boundary (step 6); the 2nd also dumps the loaded state.
    _, rec = fit(MMFSDP2Strategy(FSDP), STEPS, ckpt_path=str(work / "all" / "step=3.ckpt"))
    out["resumed_3"] = {"start": rec.start_step, "losses": rec.losses}
    _, rec = fit(
        MMFSDP2Strategy(FSDP),
        STEPS,
        ckpt_path=str(work / "all" / "step=6.ckpt"),
        callbacks=[Recorder(dump_to=work / "loaded_fsdp.pt")],
    )
    out["resumed_6"] = {"start": rec.start_step, "losses": rec.losses}

    # 3. After the crash: ckpt_path="last" picks last.ckpt (step 2), never the half-written one.
    ckpt = ModelCheckpoint(
        dirpath=work / "crash", filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    _, rec = fit(MMFSDP2Strategy(FSDP), STEPS, ckpt_path="last", callbacks=[ckpt])
    out["resumed_last_after_crash"] = {"start": rec.start_step, "losses": rec.losses}
    out["crash_listing_after"] = listing(work / "crash")

    # 4. Resharding: FSDP -> HSDP, HSDP -> FSDP, 1 rank -> 2 ranks (states compared by the test).
    t, rec = fit(
        MMFSDP2Strategy(HSDP),
        7,
        ckpt_path=str(work / "all" / "step=6.ckpt"),
        callbacks=[Recorder(dump_to=work / "loaded_hsdp.pt")],
    )
    out["hsdp_mesh"] = list(t.strategy.device_mesh.shape)
    t.save_checkpoint(work / "hsdp.ckpt")
    dump_state(t.lightning_module, t, work / "ref_hsdp.pt")
    fit(
        MMFSDP2Strategy(FSDP),
        8,
        ckpt_path=str(work / "hsdp.ckpt"),
        callbacks=[Recorder(dump_to=work / "loaded_from_hsdp.pt")],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            MMFSDP2Strategy(FSDP),
            4,
            ckpt_path=str(work / "one.ckpt"),
            callbacks=[Recorder(dump_to=work / "loaded_from_one.pt")],
        )
    out["one_to_two_warnings"] = [str(w.message) for w in caught if "saved on" in str(w.message)]

    # 5. checkpoint_format="torch": same losses, one file per checkpoint, exact resume from it.
    torch_ckpt = ModelCheckpoint(dirpath=work / "torch", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    _, rec = fit(MMFSDP2Strategy(FSDP, checkpoint_format="torch"), STEPS, callbacks=[torch_ckpt])
    out["torch_losses"] = rec.losses
    out["torch_listing"] = listing(work / "torch")
    _, rec = fit(MMFSDP2Strategy(FSDP, checkpoint_format="torch"), STEPS, ckpt_path=str(work / "torch" / "step=3.ckpt"))
    out["torch_resumed_3"] = {"start": rec.start_step, "losses": rec.losses}

    # 6. A tiny Llama (a transformers PreTrainedModel): its checkpoint records the HF config for dcp-to-hf.
    t, _ = fit(
        MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["model.layers.{*}"]}, empty_init=False),
        2,
        module=LlamaModule(),
        data=LlamaData(),
    )
    t.save_checkpoint(work / "llama.ckpt")
    dump_state(t.lightning_module, t, work / "ref_llama.pt")
    dump("main", work, rank, out)


def tiny_llama_config(tie: bool = True) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )


class LlamaModule(MMLightningModule):
    def __init__(self) -> None:
        super().__init__(lr=1e-3)

    def model_provider(self) -> nn.Module:
        from transformers import LlamaForCausalLM

        torch.manual_seed(7)
        return LlamaForCausalLM(tiny_llama_config())


class Tokens(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class LlamaData(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(), batch_size=4)


@scenario(exit_cleanly=False)
def one_rank_after(work: Path) -> None:
    """1 rank, after the 2-rank runs and the conversions: 2 -> 1 resharding, and training from converted files."""
    use_workdir(work)
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            MMFSDP2Strategy(FSDP),
            7,
            devices=1,
            ckpt_path=str(work / "all" / "step=6.ckpt"),
            callbacks=[Recorder(dump_to=work / "loaded_two_to_one.pt")],
        )
    result["two_to_one_warnings"] = [str(w.message) for w in caught if "saved on" in str(w.message)]
    # dcp-to-torch output resumes too (a consolidated file, resharded onto 1 rank).
    fit(
        MMFSDP2Strategy(FSDP),
        7,
        devices=1,
        ckpt_path=str(work / "step6.pt"),
        callbacks=[Recorder(dump_to=work / "loaded_from_torch_file.pt")],
    )
    # hf-to-dcp outputs: training starts from the Hugging Face weights (fresh optimiser and loop).
    strategy = {"sharding_size": "auto", "sub_modules_to_wrap": ["model.layers.{*}"]}
    for name in ("llama_back.ckpt", "hf_saved.ckpt"):
        _, rec = fit(
            MMFSDP2Strategy(strategy, empty_init=False),
            1,
            devices=1,
            module=LlamaModule(),
            data=LlamaData(),
            ckpt_path=str(work / name),
            callbacks=[Recorder(dump_to=work / f"loaded_{name}.pt")],
        )
        result[name] = {"start": rec.start_step, "losses": rec.losses}
    dump("one_rank_after", work, 0, result)


if __name__ == "__main__":
    scenario_kit.main()
