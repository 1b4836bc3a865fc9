"""Recomputation gives the gradients of the plain model (one process, no torch.distributed: the wrapping alone).

The 2-rank training parity of the same setups is in tests/test_parity.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mm.core import apply
from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.core.recompute import RecomputeError
from lightning_mm.core.sharding_plan import build_plan
from tests.scenarios.hf_scenarios import FamilyData, model_inputs, tiny_hf_model

CASES = {
    # family: (recompute_modules, freeze)
    "qwen2_5_vl": (["model.visual.blocks.{*}", "model.visual.merger", "model.language_model.layers.{*}"], []),
    "internvl": (["model.vision_tower.encoder.layer.{*}", "model.language_model.layers.{*}"], []),
    "llava": (["model.vision_tower.encoder.layers.{*}", "model.language_model.layers.{*}"], []),
    # No input of the recomputed layers needs a gradient: the reentrant checkpoint must still give the layers theirs.
    "qwen3": (["model.layers.{*}"], ["model.embed_tokens"]),
    # A whole sub-model that returns a ModelOutput, and builds (and would fill) its cache inside.
    "llama_tied": (["model"], []),
}


def _gradients(model: nn.Module, family: str) -> dict[str, torch.Tensor | None]:
    batch = model_inputs(torch.utils.data.default_collate([FamilyData(family)[i] for i in range(2)]))
    model(**batch).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("family", list(CASES))
def test_recomputed_gradients_equal_the_plain_model(family, use_reentrant):
    paths, frozen = CASES[family]
    plain = tiny_hf_model(family).train()
    for path in frozen:
        plain.get_submodule(path).requires_grad_(False)
    recomputed = copy.deepcopy(plain)
    plan = build_plan(FSDP2Config(recompute_modules=paths, use_reentrant=use_reentrant), recomputed, 1)
    apply.apply_recompute(recomputed, plan)
    assert any("key/value cache" in note for note in plan.notes)

    expected, actual = _gradients(plain, family), _gradients(recomputed, family)
    for name, grad in expected.items():
        if grad is None:
            assert actual[name] is None, name
        else:
            assert actual[name] is not None, f"{name}: no gradient"
            torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_generation_without_gradients_keeps_the_cache():
    model = tiny_hf_model("qwen3").eval()
    apply.apply_recompute(model, build_plan(FSDP2Config(recompute_modules=["model.layers.{*}"]), model, 1))
    with torch.no_grad():
        out = model(input_ids=torch.randint(10, 100, (1, 5)), use_cache=True)
    assert out.past_key_values.get_seq_length() == 5


def test_tensor_keyword_arguments_get_gradients_through_the_reentrant_checkpoint():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.full((3,), 2.0))

        def forward(self, x: torch.Tensor, *, shift: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> dict:
            return {"out": (x * self.weight + shift) * pair[0] + pair[1], "note": "kept"}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Scale()

    net = Net()
    apply.apply_recompute(net, build_plan(FSDP2Config(recompute_modules=["inner"], use_reentrant=True), net, 1))
    base, a, b = (torch.randn(3, requires_grad=True) for _ in range(3))
    x = base.exp()
    shift = x * 3  # not a leaf: its graph runs through x's, which the checkpoint's own input reaches too
    result = net.inner(x, shift=shift, pair=(a, b))
    assert result["note"] == "kept"
    result["out"].sum().backward()
    w = net.inner.weight.detach()
    assert torch.allclose(base.grad, (w + 3) * a.detach() * x.detach()) and torch.equal(b.grad, torch.ones(3))
    assert torch.allclose(net.inner.weight.grad, x.detach() * a.detach())
    assert torch.allclose(a.grad, x.detach() * w + shift.detach())


def test_a_recomputed_module_with_running_statistics_is_an_error_before_training():
    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    with pytest.raises(FSDP2ConfigError, match=r"`recompute_modules`.*'1' cannot be recomputed: 1 update running"):
        build_plan(FSDP2Config(recompute_modules=["1"]), net, 1)
    net[1][1] = nn.BatchNorm1d(4, track_running_stats=False)
    build_plan(FSDP2Config(recompute_modules=["1"]), net, 1)


def test_a_positional_cache_is_an_error():
    from transformers import DynamicCache

    class Layer(nn.Module):
        def forward(self, x: torch.Tensor, cache: object) -> torch.Tensor:
            return x * 2

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = Layer()

    net = Net()
    apply.apply_recompute(net, build_plan(FSDP2Config(recompute_modules=["layer"]), net, 1))
    with pytest.raises(RecomputeError, match="'layer' got a key/value cache as positional argument 1"):
        net.layer(torch.ones(2, requires_grad=True), DynamicCache())
