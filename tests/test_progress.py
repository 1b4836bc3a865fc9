"""The training bar of ``lightning-mm fit`` counts truthfully: with gradient accumulation and after a resume its
total is the batch at which the epoch's training ends, in the unit of its count (``batch_idx + 1``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_mm import MMLightningModule
from lightning_mm.commands.progress import MMProgressBar, MMTQDMProgressBar


class Regression(MMLightningModule):
    def model_provider(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(4, 1)

    def get_batch(self, batch):
        return batch

    def forward_step(self, batch):
        x, y = batch
        return self.model(x), y

    def loss_func(self, output, batch):
        prediction, target = output
        return torch.nn.functional.mse_loss(prediction, target)


class BarWatch(L.Callback):
    """After the bar's own ``on_train_batch_end``: (count, total, global_step) as the bar shows them."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        bar = trainer.progress_bar_callback
        if isinstance(bar, MMTQDMProgressBar):
            shown = (bar.train_progress_bar.n, bar.train_progress_bar.total)
        else:
            task = bar.progress.tasks[bar.train_progress_bar_id]
            shown = (int(task.completed), task.total)
        self.seen.append((*shown, trainer.global_step))


def _fit(tmp_path, bar, max_steps, accumulate=1, ckpt_path=None, every=None):
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=1)
    watch = BarWatch()
    callbacks = [bar, watch]
    if every is not None:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=every is not None,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        enable_model_summary=False,
    )
    trainer.fit(Regression(lr=1e-2), train_dataloaders=data, ckpt_path=ckpt_path)
    return trainer, watch.seen


@pytest.mark.parametrize("bar", [MMTQDMProgressBar, MMProgressBar])
def test_bar_total_counts_batches_with_accumulation(tmp_path, bar):
    trainer, seen = _fit(tmp_path, bar(), max_steps=4, accumulate=2)
    assert trainer.global_step == 4 and trainer.num_training_batches == 40
    assert trainer.fit_loop.epoch_loop.batch_progress.current.completed == 8
    # 8 batches make the 4 optimizer steps: the bar runs 1/8 .. 8/8 (Lightning's own total read 4: "8/4").
    assert [(n, total) for n, total, _ in seen] == [(i, 8) for i in range(1, 9)]


@pytest.mark.parametrize("bar", [MMTQDMProgressBar, MMProgressBar])
def test_bar_total_after_resume_mid_epoch(tmp_path, bar):
    _fit(tmp_path, bar(), max_steps=6, accumulate=2, every=3)
    ckpt = tmp_path / "ckpt" / "epoch=0-step=6.ckpt"
    assert ckpt.is_file()
    trainer, seen = _fit(tmp_path / "resumed", bar(), max_steps=16, accumulate=2, ckpt_path=ckpt)
    assert trainer.global_step == 16
    assert trainer.fit_loop.epoch_loop.batch_progress.current.completed == 32
    # The resumed epoch goes on from its 12th batch and ends at its 32nd (10 steps of 2): 13/32 .. 32/32
    # (Lightning's own total was the 10 steps left: "32/10"; without accumulation the "16/10").
    assert [(n, total) for n, total, _ in seen] == [(i, 32) for i in range(13, 33)]
    assert seen[-1][2] == 16
