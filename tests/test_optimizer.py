"""Which optimiser parameter groups get torch's fused Adam/AdamW step (the decision alone; no processes)."""

import torch
from torch import nn

from lightning_mm.core.optimizer import decide_fused_steps, use_fused_steps


def _params():
    return list(nn.Linear(4, 4).parameters())


def test_adam_and_adamw_groups_that_leave_the_implementation_open_are_switched():
    adamw = torch.optim.AdamW(_params())
    adam = torch.optim.Adam([{"params": _params()}, {"params": _params(), "foreach": False}])
    decisions = use_fused_steps([adamw, adam])
    assert [(d.optimizer, d.group, d.fused) for d in decisions] == [(0, 0, True), (1, 0, True), (1, 1, False)]
    assert adamw.param_groups[0]["fused"] is True and adam.param_groups[0]["fused"] is True
    assert adam.param_groups[1]["fused"] is None and "chooses its implementation" in decisions[2].reason


def test_other_optimizers_explicit_choices_and_stepped_optimizers_are_left_alone():
    sgd = torch.optim.SGD(_params(), lr=0.1)
    chosen = torch.optim.AdamW(_params(), fused=False)
    stepped = torch.optim.AdamW(_params())
    for p in stepped.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    stepped.step()
    reasons = [d.reason for d in use_fused_steps([sgd, chosen, stepped])]
    assert "SGD is not Adam/AdamW" in reasons[0]
    assert "chooses its implementation" in reasons[1]
    assert "already stepped" in reasons[2]
    assert sgd.param_groups[0].get("fused") is None and stepped.param_groups[0]["fused"] is None


def test_frozen_and_integer_parameters():
    frozen = _params()
    for p in frozen:
        p.requires_grad_(False)
    assert decide_fused_steps([torch.optim.AdamW(frozen)])[0].reason == "no trainable parameters"
    assert decide_fused_steps([torch.optim.AdamW(_params(), differentiable=True)])[0].fused is False


def test_the_switched_step_matches_torchs_default_to_rounding():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    use_fused_steps([opt_b])
    x = torch.randn(16, 8)
    for _ in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
