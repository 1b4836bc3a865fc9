"""The logged gradient norm and norm clipping share one computation per optimizer step."""

import lightning as L
import pytest
import torch

import lightning_mm.modules.lightning_module as module_module
import lightning_mm.strategies.precision as precision_module
from lightning_mm.core.grad_clip import total_grad_norm
from lightning_mm.strategies.precision import MMFSDP2Precision
from tests.test_module import Regression


class Norms(L.Callback):
    """The norm before clipping (callbacks run before the module's hook) and after the optimizer step."""

    def __init__(self):
        self.before, self.after = [], []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.before.append(float(total_grad_norm(list(module.parameters()))))

    def on_train_batch_end(self, trainer, module, *args):
        self.after.append(float(total_grad_norm(list(module.parameters()))))  # grads of the step just taken


@pytest.mark.parametrize("clip", [None, 0.05])
def test_grad_norm_is_computed_once_per_step_and_logged_before_clipping(tmp_path, monkeypatch, clip):
    calls = []
    real = precision_module.total_grad_norm

    def counting(params, *args, **kwargs):
        calls.append(1)
        return real(params, *args, **kwargs)

    for where in (precision_module, module_module):
        monkeypatch.setattr(where, "total_grad_norm", counting)
    logged = []

    class Module(Regression):
        def log(self, name, value, *args, **kwargs):
            if name == "train/grad_norm":
                logged.append(float(value))
            super().log(name, value, *args, **kwargs)

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    norms = Norms()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        gradient_clip_val=clip,
        plugins=[MMFSDP2Precision()],
        callbacks=[norms],
    )
    trainer.fit(Module(lr=1e-2), train_dataloaders=data)
    assert len(calls) == 4  # one reduction per step, not one for the log and one for clipping
    assert logged == pytest.approx(norms.before, rel=1e-6)  # the norm before clipping
    if clip:
        assert min(norms.before) > clip
        assert norms.after == pytest.approx([clip] * 4, rel=1e-4)
    else:
        assert norms.after == pytest.approx(norms.before, rel=1e-6)


def test_a_norm_is_not_reused_across_steps_or_optimizers():
    plugin = MMFSDP2Precision()
    w = torch.nn.Parameter(torch.ones(3))
    opt_a, opt_b = torch.optim.SGD([w], lr=1.0), torch.optim.SGD([w], lr=1.0)
    w.grad = torch.full((3,), 2.0)
    first = float(plugin.grad_norm(opt_a))
    w.grad = torch.full((3,), 4.0)
    assert float(plugin.grad_norm(opt_b)) == pytest.approx(2 * first)  # another optimizer: computed anew
    plugin.clip_grad_by_norm(opt_b, 1.0)  # consumes the norm
    assert float(plugin.grad_norm(opt_b)) == pytest.approx(1.0, rel=1e-5)
