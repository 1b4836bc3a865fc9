"""Meta-device init of torch's own layers gives what their constructors give (one process, no distributed).

Built on the meta device and materialised from the same seed, a model comes out bit for bit equal to the eagerly
built one: same methods, same order, same random draws. The 2-rank run of such a model is in tests/test_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mm.core.apply import materialize_and_init
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.hf.mixins import WeightInitMixin

CPU = torch.device("cpu")


class TorchLayers(nn.Module):
    """Every torch.nn layer with parameters whose init is not a plain ``reset_parameters()`` of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8, padding_idx=3)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2, enable_nested_tensor=False
        )
        self.decoder_layer = nn.TransformerDecoderLayer(8, 2, 16)
        self.attention = nn.MultiheadAttention(8, 2, add_bias_kv=True, kdim=6, vdim=5)
        self.transformer = nn.Transformer(8, 2, 1, 1, 16)
        self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(8, 20, [5, 10])
        self.others = nn.ModuleList(
            [
                nn.PReLU(3),
                nn.GRU(4, 5),
                nn.Bilinear(3, 4, 5),
                nn.Conv1d(2, 3, 3),
                nn.GroupNorm(2, 4),
                nn.RMSNorm(4),
                nn.BatchNorm1d(3),
                nn.EmbeddingBag(7, 4),
            ]
        )


class ZeroInitProjection(nn.Module):
    """A user module whose ``reset_parameters()`` changes a child's init, as constructors often do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)


def _meta_built(cls: type[nn.Module], seed: int) -> nn.Module:
    with meta_parameters():
        model = cls()
    torch.manual_seed(seed)
    materialize_and_init(model, model, CPU, CPU)
    return model


@pytest.mark.parametrize("cls", [TorchLayers, ZeroInitProjection])
def test_meta_init_equals_the_eager_constructors(cls):
    torch.manual_seed(7)
    eager = cls()
    lazy = _meta_built(cls, seed=7)
    state = lazy.state_dict()
    differ = [name for name, tensor in eager.state_dict().items() if not torch.equal(tensor, state[name])]
    assert differ == []


def test_encoder_layers_start_as_copies_and_attention_biases_are_zero():
    model = _meta_built(TorchLayers, seed=1)
    first, second = model.encoder.layers
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert torch.all(first.self_attn.in_proj_bias == 0) and torch.all(first.self_attn.out_proj.bias == 0)
    assert torch.all(model.embed.weight[3] == 0)


def test_weight_init_mixin_initialises_multihead_attention():
    class Custom(nn.Module, WeightInitMixin):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(8, 2)
            self.norm = nn.LayerNorm(8)

    model = _meta_built(Custom, seed=0)
    attention = model.attention
    bound = (6 / sum(attention.in_proj_weight.shape)) ** 0.5  # torch's xavier_uniform_
    assert 0 < attention.in_proj_weight.abs().max() <= bound
    assert torch.all(attention.in_proj_bias == 0) and torch.all(attention.out_proj.bias == 0)
    assert float(attention.out_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.3)  # the mixin's Linear rule


def test_materialising_keeps_state_that_is_neither_parameter_nor_buffer():
    """torchmetrics keeps metric states as plain attributes and moves them in ``_apply``: materialising the meta
    parameters next to them must leave them alone (a module-wide ``to_empty`` filled them with garbage)."""
    from torchmetrics import MeanMetric

    with meta_parameters():
        model = nn.ModuleDict({"proj": nn.Linear(4, 4), "metric": MeanMetric()})
    model["metric"].update(torch.tensor([2.0, 4.0]))
    materialize_and_init(model, model, CPU, CPU)
    assert not model["proj"].weight.is_meta
    assert float(model["metric"].compute()) == 3.0
    model["metric"].reset()
    model["metric"].update(torch.tensor(5.0))
    assert float(model["metric"].compute()) == 5.0
