"""MMLightningModule: hooks, seed callables, loss forms, the LR schedule, and Lightning's own strategies."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import Logger
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
    with pytest.raises(ValueError, match=r"eps must be a positive number .AdamW's denominator term., got 0"):
        MMLightningModule(eps=0)
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


class MemoryLogger(Logger):
    """Keeps what Lightning writes to loggers: ``(global_step, metrics)`` per call."""

    def __init__(self):
        super().__init__()
        self.written = []
        self.trainer = None

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.written.append((self.trainer.global_step if self.trainer else step, dict(metrics)))

    def keys_at(self, step):
        return sorted({k for s, m in self.written if s == step for k in m})


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
    logger = MemoryLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=40,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[recorder],
        default_root_dir=tmp_path,
        log_every_n_steps=10,
    )
    logger.trainer = trainer
    module = Regression(lr=3e-2, warmup_steps=5, lr_decay_style="cosine", min_lr=3e-3)
    trainer.fit(module, train_dataloaders=data)
    assert recorder.losses[-1] < 0.3 * recorder.losses[0]
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/bias", "train/lr", "train/grad_norm"):
        assert key in metrics
    assert float(metrics["train/lr"]) == pytest.approx(3e-3, rel=0.05)  # decayed to min_lr at the end
    assert math.isfinite(float(metrics["train/grad_norm"]))
    rates = [m["train/device/samples_per_sec"] for _, m in logger.written if "train/device/samples_per_sec" in m]
    assert len(rates) == 4 and all(math.isfinite(r) and r > 0 for r in rates)  # ThroughputMonitor's, every 10


def test_throughput_and_grad_norm_are_computed_only_on_steps_whose_logs_are_written(tmp_path):
    seen = []

    class Watch(L.Callback):  # what the steps before this one logged
        def on_train_batch_start(self, trainer, module, batch, idx):
            seen.append(sorted(k for k in trainer.callback_metrics if k != "train/bias"))

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    logger = MemoryLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[Watch()],
        default_root_dir=tmp_path,
        log_every_n_steps=4,
    )
    logger.trainer = trainer
    trainer.fit(Regression(lr=1e-2), train_dataloaders=data)
    every_step = ["train/loss", "train/lr"]
    assert seen[1:4] == [every_step] * 3  # after steps 1-3: not written, so not computed
    assert seen[4] == ["train/grad_norm", "train/loss", "train/lr"]  # step 4: written
    # Throughput (Lightning's ThroughputMonitor) is computed and written on the same steps only: after step 4.
    throughput = [step for step, m in logger.written if any(k.endswith("_per_sec") for k in m)]
    assert throughput == [4]
    assert {"train/device/samples_per_sec", "train/device/items_per_sec"} <= set(logger.keys_at(4))
    written = [step for step, m in logger.written if "train/grad_norm" in m]
    assert written == [4]


def test_throughput_monitor_is_lightnings_and_the_users_own_wins(tmp_path):
    module = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, log_every_n_steps=5, accumulate_grad_batches=3)
    module.trainer = trainer
    (monitor,) = module.configure_callbacks()
    assert isinstance(monitor, ThroughputMonitor)
    assert monitor.kwargs == {"window_size": 15}  # the batches between two written logs
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "attention_mask": mask}
    assert (monitor.batch_size_fn(batch), monitor.length_fn(batch)) == (2, 9)  # non-padding tokens
    assert (monitor.batch_size_fn((torch.ones(4, 2), 0)), monitor.length_fn((torch.ones(4, 2), 0))) == (4, 4)
    own = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[ThroughputMonitor(len)])
    module.trainer = own
    assert module.configure_callbacks() == []
    module.trainer = trainer
    assert Regression(log_throughput=False).configure_callbacks() == []


def test_ddp_fit_with_seed_callables_in_megatron_form(scenario):
    from tests.scenarios import dist_scenarios

    r0, r1 = scenario(dist_scenarios.ddp_module)
    assert r0["strategy"] == "DDPStrategy"
    assert r0["losses"][-1] < r0["losses"][0]
    assert "train/doubled" in r0["logged"] and "train/grad_norm" in r0["logged"]


def test_the_default_optimizer_is_adamw_with_the_given_settings():
    """``eps`` (MindSpeed MM's ``--adam-eps`` / ``training.adam_eps``) reaches AdamW with the other settings."""
    module = Regression(lr=2e-3, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-5)
    module.configure_model()
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (2e-3, 0.1, (0.8, 0.95), 1e-5)
