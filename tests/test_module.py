"""MMLightningModule: hooks, seed callables, loss forms, the LR schedule, and Lightning's own strategies."""

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mm import MMLightningModule
from lightning_mm.modules.lightning_module import _split_loss, lr_factor


def test_lr_schedule_warmup_then_decay_to_min():
    assert lr_factor(0, 10, 110, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 110, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 10, 110, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(60, 10, 110, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(110, 10, 110, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(500, 10, 110, "linear", 0.0) == pytest.approx(0.0)
    assert lr_factor(60, 10, 110, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(60, 0, 110, "constant", 0.0) == 1.0


@pytest.mark.parametrize(
    ("result", "extras"),
    [
        (torch.tensor(2.0), {}),
        ({"loss": torch.tensor(2.0), "acc": 0.5}, {"acc": 0.5}),
        ((torch.tensor(2.0), {"lm loss": 1.0}), {"lm loss": 1.0}),
    ],
)
def test_loss_forms(result, extras):
    loss, got = _split_loss(result, "M")
    assert float(loss) == 2.0 and got == extras


@pytest.mark.parametrize("bad", [{"lsos": torch.tensor(1.0)}, (torch.tensor(1.0), 3), torch.ones(3), "x"])
def test_bad_loss_forms_are_errors(bad):
    with pytest.raises((KeyError, TypeError)):
        _split_loss(bad, "M")


def test_constructor_validation_and_import_paths():
    with pytest.raises(ValueError, match="lr_decay_style"):
        MMLightningModule(lr_decay_style="wsd")
    with pytest.raises(ValueError, match="min_lr"):
        MMLightningModule(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ImportError, match="cannot import module"):
        MMLightningModule(model_provider="no_such_module.model_provider")
    module = MMLightningModule(model_provider="examples.migration.pretrain_custom.model_provider")
    module.configure_model()
    first = module.model
    module.configure_model()  # never rebuilt
    assert module.model is first and isinstance(first, nn.Module)
    with pytest.raises(NotImplementedError, match="model_provider"):
        MMLightningModule().configure_model()


class Regression(MMLightningModule):
    def model_provider(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def get_batch(self, batch):
        return batch

    def forward_step(self, batch):
        x, y = batch
        return self.model(x), y

    def loss_func(self, output, batch):
        prediction, target = output
        return {"loss": torch.nn.functional.mse_loss(prediction, target), "bias": prediction.mean()}


class Recorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        self.losses.append(float(outputs["loss"]))


def test_single_device_fit_with_hooks_and_default_schedule(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=40, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[recorder], default_root_dir=tmp_path,
                        log_every_n_steps=10)
    module = Regression(lr=3e-2, warmup_steps=5, lr_decay_style="cosine", min_lr=3e-3)
    trainer.fit(module, train_dataloaders=data)
    assert recorder.losses[-1] < 0.3 * recorder.losses[0]
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/bias", "train/lr", "train/grad_norm", "train/samples_per_sec"):
        assert key in metrics
    assert float(metrics["train/lr"]) == pytest.approx(3e-3, rel=0.05)  # decayed to min_lr at the end
    assert math.isfinite(float(metrics["train/grad_norm"]))


def test_throughput_and_grad_norm_are_computed_only_on_steps_whose_logs_are_written(tmp_path):
    seen = []

    class Watch(L.Callback):  # what the steps before this one logged
        def on_train_batch_start(self, trainer, module, batch, idx):
            seen.append(sorted(k for k in trainer.callback_metrics if k != "train/bias"))

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[Watch()], default_root_dir=tmp_path,
                        log_every_n_steps=4)
    trainer.fit(Regression(lr=1e-2), train_dataloaders=data)
    every_step = ["train/loss", "train/lr"]
    assert seen[1:4] == [every_step] * 3  # after steps 1-3: not written, so not computed
    assert seen[4] == ["train/grad_norm", "train/loss", "train/lr", "train/samples_per_sec"]  # step 4: written


def test_ddp_fit_with_seed_callables_in_megatron_form(scenario):
    r0, r1 = scenario("ddp_module")
    assert r0["strategy"] == "DDPStrategy"
    assert r0["losses"][-1] < r0["losses"][0]
    assert "train/doubled" in r0["logged"] and "train/grad_norm" in r0["logged"]
