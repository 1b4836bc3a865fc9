"""Token-budget batches on 2 and 4 ranks: ``python tests/scenarios/packing_scenarios.py SCENARIO OUTDIR``
(scenario_kit).

A custom causal LM (:class:`TinyRopeLM`, sdpa with the packed block-diagonal mask) trains with ``MMFSDP2Strategy``
on packed token-budget batches of samples with long-tailed lengths (``MMDataModule(packing=True,
max_tokens_per_rank=...)``) for two epochs; FSDP2 gathers parameters in every step, so a rank that ran a step
more than the others would hang the run. Every rank writes, per step, the epoch, the global step, the samples in
its row (each sample's first token is its id) and the loss. ``two`` also resumes from a mid-epoch checkpoint on 2
ranks (checkpoints in ``OUTDIR/ckpt``); ``four`` resumes the 2-rank checkpoint on 4 ranks (another world size) and
trains the next epoch there. ``two`` also runs one step of ``OUTDIR/qwen3`` (a saved Transformers Qwen3) on a
packed row under 2-rank context parallelism. ``stateful`` runs one FSDP2 step of ``OUTDIR/qwen3_5`` (Qwen3.5: Gated
DeltaNet) on a packed row. ``mismatch --arg case=fewer``: rank 1's dataset has one sample fewer (``case=empty``:
none); every rank writes the error the fit ended with and how long after its start (one failed fit a launch: the
strategy destroys the process group after a failed run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mm import MMDataModule, MMFSDP2Strategy  # noqa: E402
from lightning_mm.core.packed_rows import IGNORE_INDEX, block_causal_mask, segment_ids  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

VOCAB = 128
SAMPLES = 39  # 11 batches an epoch: not a multiple of 2 or 4 ranks (the last step repeats the first batches)
MAX_TOKENS = 64
BUFFER = 16
SEED = 5
EPOCHS = 2
RESUME_STEP = 3  # a checkpoint every 3 steps; the resumed runs start at step 3 (mid-epoch 0)
ID_OFFSET = 10


def skewed_lengths(n: int = SAMPLES) -> list[int]:
    """Long-tailed: most samples short, a few near the budget (``4 + 56 u^3``, ``u`` uniform, seeded)."""
    g = torch.Generator().manual_seed(0)
    return [4 + int(56 * float(u) ** 3) for u in torch.rand(n, generator=g)]


class SkewedData(torch.utils.data.Dataset):
    """Sample ``i``: ``lengths[i]`` tokens, the first one ``ID_OFFSET + i`` (its id), every token a target."""

    def __init__(self, n: int = SAMPLES) -> None:
        self.lengths = skewed_lengths(n)

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_lengths(self) -> list[int]:
        return list(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(ID_OFFSET + SAMPLES, VOCAB, (self.lengths[i],), generator=g)
        ids[0] = ID_OFFSET + i
        return {"input_ids": ids, "labels": ids.clone()}


class TinyRopeLM(nn.Module):
    """A custom causal LM: rotary positions from ``position_ids``, sdpa with the packed block-diagonal mask."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, hidden // heads, 2) / (hidden // heads)))

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        freqs = position_ids[:, None, :, None].float() * self.inv_freq
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

        def rotate(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-t2, t1], -1) * sin

        attn = F.scaled_dot_product_attention(rotate(q), rotate(k), v, attn_mask=block_causal_mask(position_ids))
        logits = self.head(x + self.proj(attn.transpose(1, 2).reshape(b, s, -1)))
        return (
            F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            / (labels[:, 1:] != IGNORE_INDEX).sum()
        )


class PackedLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.model = TinyRopeLM()

    def training_step(self, batch: dict[str, torch.Tensor], idx: int) -> torch.Tensor:
        return self.model(**batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        ids, positions = batch["input_ids"][0], batch["position_ids"]
        starts = torch.diff(segment_ids(positions)[0], prepend=torch.tensor([-1])) != 0
        self.steps.append(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "samples": (ids[starts] - ID_OFFSET).tolist(),
                "tokens": int(ids.numel()),
                "loss": float(outputs["loss"].detach()),
            }
        )


def fit(
    devices: int,
    outdir: str,
    ckpt_path: str | None = None,
    save_dir: str | None = None,
    samples_of_rank: Any = lambda rank: SAMPLES,
    max_epochs: int = EPOCHS,
) -> tuple[int, list]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    recorder = Recorder()
    callbacks: list[L.Callback] = [recorder]
    if save_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, every_n_train_steps=RESUME_STEP, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        strategy=MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["model.qkv", "model.head"]}),
    )
    data = MMDataModule(
        train_dataset=SkewedData(samples_of_rank(trainer.global_rank)),
        packing=True,
        max_tokens_per_rank=MAX_TOKENS,
        packing_buffer_size=BUFFER,
        seed=SEED,
    )
    trainer.fit(PackedLM(), datamodule=data, ckpt_path=ckpt_path)
    return trainer.global_rank, recorder.steps


def dump(name: str, outdir: str, rank: int, data: dict[str, Any]) -> None:
    Path(outdir, f"{name}.rank{rank}.json").write_text(json.dumps(data))


def context_parallel_step(outdir: str, model_dir: str) -> None:
    """One step of a Transformers Qwen3 on one packed row split over 2 context-parallel ranks: rank 0 saves the
    loss and the gathered gradients to ``OUTDIR/cp.pt`` (the test compares them with plain Transformers)."""
    from torch.distributed.tensor import DTensor

    from lightning_mm import MMLightningModule
    from lightning_mm.core.packed_rows import PackedCollator
    from lightning_mm.modules import TransformersModel
    from tests.test_packing import samples_of

    result: dict[str, Any] = {}

    class Module(MMLightningModule):
        def model_provider(self) -> nn.Module:
            return TransformersModel({"init_from_hf_path": model_dir})

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            result["loss"] = loss.detach().clone()
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            result["grads"] = {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in self.model.named_parameters()
                if p.grad is not None
            }  # collectives

    packed = PackedCollator()(samples_of("qwen3"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy({"sharding_size": "auto"}, context_parallel_size=2),
    )
    loader = torch.utils.data.DataLoader([packed], batch_size=None)
    trainer.fit(Module(log_grad_norm=False), train_dataloaders=loader)
    if trainer.global_rank == 0:
        torch.save(result, Path(outdir, "cp.pt"))


def fsdp2_step(
    outdir: str,
    model_dir: str,
    name: str,
    wrap: list[str],
    recompute: list[str],
    context_parallel_size: int = 1,
    packed: bool = True,
    tag: str = "",
) -> None:
    """One FSDP2 step (2 ranks, both on the same packed row of ``tests.test_packing.samples_of(name)``) of the
    saved Transformers model in ``model_dir``: rank 0 saves the loss and the gathered gradients to
    ``OUTDIR/<name>.pt`` (the test compares them with plain Transformers on the padded samples)."""
    from torch.distributed.tensor import DTensor

    from lightning_mm import MMLightningModule
    from lightning_mm.core.packed_rows import PackedCollator
    from lightning_mm.modules import TransformersModel
    from tests.test_packing import samples_of

    result: dict[str, Any] = {}

    class Module(MMLightningModule):
        def model_provider(self) -> nn.Module:
            return TransformersModel({"init_from_hf_path": model_dir})

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            result["loss"] = loss.detach().clone()
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            result["grads"] = {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in self.model.named_parameters()
                if p.grad is not None
            }  # collectives

    from lightning_mm.hf.chat_collate import ChatCollator

    batch = (PackedCollator() if packed else ChatCollator(pad_token_id=0))(samples_of(name))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy(
            {"sharding_size": "auto", "sub_modules_to_wrap": wrap, "recompute_modules": recompute},
            context_parallel_size=context_parallel_size,
        ),
    )
    loader = torch.utils.data.DataLoader([batch], batch_size=None)
    trainer.fit(Module(log_grad_norm=False), train_dataloaders=loader)
    if trainer.global_rank == 0:
        torch.save(result, Path(outdir, f"{name}{tag}.pt"))


@scenario
def stateful(outdir: Path) -> None:
    """Qwen3.5 (Gated DeltaNet run once per packed sample, images in the row) under FSDP2 on 2 ranks: decoder
    layers and the linear-attention layer sharded as units of their own, decoder layers recomputed; then the same
    under context parallel 2, on the packed row and on the padded batch of its samples."""
    layers = "model.language_model.layers.{*}"
    wrap = ["model.language_model.layers.0.linear_attn", layers]
    fsdp2_step(str(outdir), str(Path(outdir, "qwen3_5")), "qwen3_5", wrap, [layers])
    # Context parallel 2: the Gated DeltaNet layer on the whole sequence gathered over the group.
    for packed, tag in ((True, ".cp2"), (False, ".cp2-padded")):
        fsdp2_step(str(outdir), str(Path(outdir, "qwen3_5")), "qwen3_5", wrap, [layers], 2, packed, tag)


@scenario
def two(outdir: Path) -> None:
    ckptdir = str(Path(outdir, "ckpt"))
    rank, full = fit(2, outdir, save_dir=ckptdir)
    _, resumed = fit(2, outdir, ckpt_path=f"{ckptdir}/epoch=0-step={RESUME_STEP}.ckpt")
    context_parallel_step(outdir, str(Path(outdir, "qwen3")))
    dump("two", outdir, rank, {"full": full, "resumed": resumed})


@scenario
def mismatch(outdir: Path, case: str) -> None:
    """Rank 1 loads one sample fewer (``fewer``: another plan) or none (``empty``: its plan fails): the ranks must
    all fail before their first step, within seconds."""
    import time

    from lightning_mm.core.token_budget_plan import TokenBudgetError

    samples = {"fewer": lambda rank: SAMPLES - rank, "empty": lambda rank: SAMPLES * (1 - rank)}[case]
    start, error = time.monotonic(), None
    try:
        fit(2, str(outdir), samples_of_rank=samples, max_epochs=1)
    except TokenBudgetError as err:
        error = str(err)
    scenario_kit.write_result(outdir, "mismatch", {"error": error, "seconds": time.monotonic() - start})


@scenario
def four(outdir: Path) -> None:
    ckptdir = str(Path(outdir, "ckpt"))  # the checkpoints of ``two``
    # Saved on 2 ranks: the rest of epoch 0, then a whole epoch, on 4.
    rank, resumed = fit(4, outdir, ckpt_path=f"{ckptdir}/epoch=0-step={RESUME_STEP}.ckpt")
    dump("four", outdir, rank, {"resumed": resumed})


if __name__ == "__main__":
    scenario_kit.main()
