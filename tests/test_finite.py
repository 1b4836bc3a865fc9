"""A non-finite loss or gradient norm stops training on every rank before the optimizer step applies it.

In-process: the precision plugin on one device (fast). Two ranks: tests/scenarios/finite_scenarios.py, started here as
two processes (as an external launcher starts them) so that each rank's exit status is seen.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_mm import MMFSDP2Strategy
from lightning_mm.checkpoint import open_source
from lightning_mm.core.finite import NonFiniteError, check_step, rank_flags
from lightning_mm.core.grad_clip import total_grad_norm
from lightning_mm.strategies.precision import MMFSDP2Precision
from tests.helpers.scenario_kit import run
from tests.scenarios import finite_scenarios
from tests.test_module import Regression

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ one process
class Faulty(Regression):
    """``nan_at``: the step whose loss is NaN; ``inf_grad_at``: the step whose gradients a hook makes infinite."""

    def __init__(self, nan_at: int | None = None, inf_grad_at: int | None = None, **kwargs) -> None:
        super().__init__(lr=1e-2, **kwargs)
        self.nan_at, self.inf_grad_at = nan_at, inf_grad_at

    def forward_step(self, batch):
        x, y = batch
        hidden = self.model[1](self.model[0](x))
        if self.trainer.global_step == self.inf_grad_at:
            hidden.register_hook(lambda g: torch.full_like(g, float("inf")))
        return self.model[2](hidden), y

    def loss_func(self, output, batch):
        out = super().loss_func(output, batch)
        if self.trainer.global_step == self.nan_at:
            out["loss"] = out["loss"] * float("nan")
        return out


class Snapshot(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, idx):
        self.weights = {n: p.detach().clone() for n, p in module.named_parameters()}


def _fit(tmp_path, module, plugin, **kwargs):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    snapshot = Snapshot()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        plugins=[plugin],
        callbacks=[snapshot],
        **kwargs,
    )
    return trainer, snapshot, lambda: trainer.fit(module, train_dataloaders=data)


def _unchanged(module, snapshot) -> bool:
    return all(torch.equal(p, snapshot.weights[n]) for n, p in module.named_parameters())


def test_a_nan_loss_stops_before_the_step_naming_it(tmp_path):
    module = Faulty(nan_at=2)
    trainer, snapshot, fit = _fit(tmp_path, module, MMFSDP2Precision())
    with pytest.raises(
        NonFiniteError,
        match=r"^non-finite loss at step 2, gradient norm nan: training stopped on "
        r"every rank before the optimizer step applied it \(the weights stay as "
        r"after 2 optimizer step\(s\)\); MMFSDP2Strategy\(stop_on_nonfinite="
        r"False\) trains on instead$",
    ):
        fit()
    assert trainer.global_step == 2 and _unchanged(module, snapshot)
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_an_infinite_gradient_stops_before_the_step_even_with_accumulation(tmp_path):
    module = Faulty(inf_grad_at=1)
    trainer, snapshot, fit = _fit(tmp_path, module, MMFSDP2Precision(), accumulate_grad_batches=2)
    with pytest.raises(
        NonFiniteError,
        match=r"non-finite gradient norm \((inf|nan)\) at step 1, the loss being "
        "finite on every rank",
    ):
        fit()
    assert trainer.global_step == 1 and _unchanged(module, snapshot)


def test_a_nan_loss_in_an_earlier_micro_batch_is_seen_at_the_step(tmp_path):
    class FirstMicroBatch(Faulty):
        def loss_func(self, output, batch):
            out = Regression.loss_func(self, output, batch)
            if self.trainer.global_step == 1 and self.trainer.fit_loop.batch_idx == 2:  # the first of two
                out["loss"] = out["loss"] * float("inf")
            return out

    module = FirstMicroBatch()
    _, _, fit = _fit(tmp_path, module, MMFSDP2Precision(), accumulate_grad_batches=2)
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 1"):
        fit()


def test_opting_out_trains_on(tmp_path):
    module = Faulty(nan_at=2)
    trainer, _, fit = _fit(tmp_path, module, MMFSDP2Precision(stop_on_nonfinite=False))
    fit()
    assert trainer.global_step == 5
    assert not all(torch.isfinite(p).all() for p in module.parameters())  # what the check prevents


def test_gradient_clipping_and_the_logged_norm_reuse_the_checks_norm(tmp_path, monkeypatch):
    import lightning_mm.strategies.precision as precision_module

    calls = []
    real = precision_module.total_grad_norm

    def counting(*args, **kwargs):
        calls.append(kwargs.get("also_reduce") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(precision_module, "total_grad_norm", counting)
    trainer, _, fit = _fit(tmp_path, Faulty(), MMFSDP2Precision(), gradient_clip_val=0.01, log_every_n_steps=1)
    fit()
    assert calls == [True] * 5  # one norm per step: the check's, with the flags


def test_the_strategy_option_is_checked_and_reaches_the_plugin():
    with pytest.raises(TypeError, match="stop_on_nonfinite must be True or False"):
        MMFSDP2Strategy(stop_on_nonfinite="no")
    assert MMFSDP2Strategy().stop_on_nonfinite is True
    assert MMFSDP2Strategy(stop_on_nonfinite=False).stop_on_nonfinite is False


def test_also_reduce_is_left_as_is_on_one_process_and_the_norm_unchanged():
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    flags = rank_flags(torch.tensor(True), torch.device("cpu"))
    assert flags.tolist() == [1.0]
    assert float(total_grad_norm([w], also_reduce=flags)) == pytest.approx(math.sqrt(12))
    assert flags.tolist() == [1.0]
    with pytest.raises(NonFiniteError, match="non-finite loss at step 7:"):
        check_step(flags, torch.tensor(1.0), 7, "x")
    check_step(torch.zeros(1), torch.tensor(1.0), 7, "x")  # all finite: nothing
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 3 on ranks 0, 2 \(of 4\), gradient norm nan"):
        check_step(torch.tensor([1.0, 0, 1, 0]), torch.tensor(float("nan")), 3, "x")


# -------------------------------------------------------------------------------------------- 2 ranks
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    work = tmp_path_factory.mktemp("finite")
    procs = run(finite_scenarios.three_runs, work, launcher="per_rank", expect_ok=False, timeout=600)
    return work, [p.returncode for p in procs], [p.stderr for p in procs]


def _ranks(work: Path, run: str) -> list[dict]:
    return [json.loads((work / f"{run}.rank{r}.json").read_text()) for r in range(2)]


def test_a_nan_loss_on_one_rank_stops_both_ranks_non_zero_naming_step_and_rank(two_ranks):
    work, codes, stderr = two_ranks
    assert all(code != 0 for code in codes), (codes, [e[-3000:] for e in stderr])
    message = "non-finite loss at step 3 on rank 1 (of 2), gradient norm nan: training stopped on every rank before"
    for rank, obs in enumerate(_ranks(work, "nan_loss")):
        assert obs["error"].startswith(message), obs["error"]
        assert message in stderr[rank]
        assert obs["global_step"] == 3 and len(obs["losses"]) == 3
        assert obs["unchanged"] and obs["finite_after"]  # step 3 was not applied
        assert obs["reduces"] == [1, 1, 1]  # the loss flags ride in the norm's own all-reduce
    # The last checkpoint (after step 3, before the failing one) holds the finite weights the run stopped with.
    last = open_source(work / "ckpt" / "step=3.ckpt")
    assert not (work / "ckpt" / "step=4.ckpt").exists()
    before = torch.load(work / "before_step3.pt", weights_only=True)
    saved = last.read_full([f"state_dict/{n}" for n in before])
    for name, value in before.items():
        assert torch.isfinite(value).all() and torch.equal(saved[f"state_dict/{name}"], value), name


def test_an_infinite_gradient_on_one_rank_stops_both(two_ranks):
    work, _, _ = two_ranks
    for obs in _ranks(work, "inf_grad"):
        assert "non-finite gradient norm" in obs["error"] and "at step 2, the loss being finite" in obs["error"]
        assert obs["global_step"] == 2 and obs["unchanged"] and obs["finite_after"]


def test_opting_out_trains_on_on_both_ranks(two_ranks):
    work, _, _ = two_ranks
    for obs in _ranks(work, "opt_out"):
        assert obs["error"] is None and obs["global_step"] == 5
        assert not obs["finite_after"]  # the NaN reached every rank's weights
        assert obs["reduces"] == [0] * 5  # no check, no norm (nothing logs or clips it)
