"""The captioning demo's accuracies are torchmetrics metrics: compared with the hand-written formulas they
replace (token accuracy over scored tokens, a caption right when all its scored tokens are)."""

import pytest
import torch

from examples.captioning.module import IGNORE, CaptioningModule


def _batches(n=5):
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        size = 3 + i  # batches of different sizes
        logits = torch.randn(size, 9, 12, generator=g)
        labels = torch.randint(0, 12, (size, 9), generator=g)
        labels[:, : 2 + i % 3] = IGNORE  # prompts of different lengths
        predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
        predicted[0] = torch.where(target[0] == IGNORE, predicted[0], target[0])  # one caption right
        yield predicted, target


def _former(predicted, target):
    scored = target != IGNORE
    correct = (predicted == target) & scored
    return float(correct.sum() / scored.sum().clamp(min=1)), float((correct | ~scored).all(dim=1).float().mean())


def test_step_values_equal_the_former_formulas_and_epoch_values_count_every_token():
    module = CaptioningModule()
    train = module.accuracy["train_acc"]
    seen_p, seen_t = [], []
    for predicted, target in _batches():
        step = {name: float(metric(predicted, target)) for name, metric in train.items()}
        token, caption = _former(predicted, target)
        assert step == {"token_acc": pytest.approx(token, abs=1e-7), "caption_acc": pytest.approx(caption, abs=1e-7)}
        seen_p.append(predicted.flatten())
        seen_t.append(target.flatten())
    # Over the epoch: every scored token counts once (the former per-epoch value was a mean of batch ratios).
    predicted, target = torch.cat(seen_p), torch.cat(seen_t)
    scored = target != IGNORE
    assert float(train["token_acc"].compute()) == pytest.approx(float((predicted == target)[scored].float().mean()))
    assert float(train["caption_acc"].compute()) == pytest.approx(5 / sum(3 + i for i in range(5)))


def test_each_stage_has_its_own_state():
    module = CaptioningModule()
    predicted, target = next(_batches(1))
    module.accuracy["val_acc"]["token_acc"].update(predicted, target)
    assert module.accuracy["test_acc"]["token_acc"].update_count == 0
    assert module.accuracy["train_acc"]["token_acc"].dist_sync_on_step
    assert not module.accuracy["val_acc"]["token_acc"].dist_sync_on_step
