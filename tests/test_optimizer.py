"""Which optimiser parameter groups get torch's fused Adam/AdamW step (the decision alone; no processes)."""

import pytest
import torch
from torch import nn

from lightning_mm.core.optimizer import FusedSteps, decide_fused_steps


def _params():
    return list(nn.Linear(4, 4).parameters())


def test_adam_and_adamw_groups_that_leave_the_implementation_open_are_switched():
    adamw = torch.optim.AdamW(_params())
    adam = torch.optim.Adam([{"params": _params()}, {"params": _params(), "foreach": False}])
    fused = FusedSteps()
    decisions = fused.choose([adamw, adam])
    assert [(d.optimizer, d.group, d.fused) for d in decisions] == [(0, 0, True), (1, 0, True), (1, 1, False)]
    assert fused.groups(adamw) == (0,) and fused.groups(adam) == (0,)
    assert "chooses its implementation" in decisions[2].reason


def test_other_optimizers_explicit_choices_and_stepped_optimizers_are_left_alone():
    sgd = torch.optim.SGD(_params(), lr=0.1)
    chosen = torch.optim.AdamW(_params(), fused=False)
    stepped = torch.optim.AdamW(_params())
    for p in stepped.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    stepped.step()
    fused = FusedSteps()
    reasons = [d.reason for d in fused.choose([sgd, chosen, stepped])]
    assert "SGD is not Adam/AdamW" in reasons[0]
    assert "chooses its implementation" in reasons[1]
    assert "already stepped" in reasons[2]
    assert fused.groups(sgd) == fused.groups(chosen) == fused.groups(stepped) == ()


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
    fused = FusedSteps()
    fused.choose([opt_b])
    x = torch.randn(16, 8)
    for _ in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):

            def closure(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                return loss

            with fused.step(opt, closure) as step_closure:
                opt.step(step_closure)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_the_fused_step_is_used_for_the_update_and_never_left_in_the_groups():
    """The group reads ``fused=True`` only between the closure and the end of the step (torch's fused kernel runs:
    its ``step`` count is float32 on the parameter's device); before, after, and after a step that raised, the
    group and ``state_dict()`` hold the user's values, key for key."""
    net = nn.Linear(4, 4)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    given = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    fused = FusedSteps()
    fused.choose([opt])
    seen: list[object] = []

    def closure() -> torch.Tensor:
        seen.append(opt.param_groups[0]["fused"])
        loss = net(torch.ones(2, 4)).square().sum()
        loss.backward()
        return loss

    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["fused"]))
    with fused.step(opt, closure) as step_closure:
        opt.step(step_closure)
    assert seen == [None, True]  # the user's value in the forward/backward, the fused kernel for the update
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == given
    assert opt.state_dict()["param_groups"][0]["fused"] is None

    def failing() -> torch.Tensor:
        closure()
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"), fused.step(opt, failing) as step_closure:
        opt.step(step_closure)
    assert opt.param_groups[0]["fused"] is None

    # After a load (new group dicts) the groups are found again by index; a group that now chooses is left alone.
    opt.load_state_dict(opt.state_dict())
    seen.clear()
    with fused.step(opt, closure) as step_closure:
        opt.step(step_closure)
    assert seen == [None, True] and opt.param_groups[0]["fused"] is None
    opt.param_groups[0]["foreach"] = False
    seen.clear()
    with fused.step(opt, closure) as step_closure:
        opt.step(step_closure)
    assert seen == [None, None]
