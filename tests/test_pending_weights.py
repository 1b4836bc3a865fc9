"""lightning_mm/hf/pending_weights.py: what a meta-built model still has to receive after sharding is kept beside the
user's model (weakly keyed), not written on it, and behaves as before: zero-filled init, loading, LoRA values."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers

from lightning_mm.core.init_context import meta_parameters
from lightning_mm.hf import pending_weights
from lightning_mm.hf.pending_weights import pending_lora, pending_pretrained
from lightning_mm.modules import TransformersModel
from tests.scenarios.hf_scenarios import save_tiny_checkpoints

LORA = {"rank": 4, "alpha": 8, "target_modules": ["model.layers.{*}.self_attn.q_proj"]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoints(tmp_path_factory.mktemp("pending"), ["qwen3"])["qwen3"]


def test_a_meta_built_model_carries_no_pending_state_and_loads_after_sharding(ckpt):
    with meta_parameters():
        model = TransformersModel({"init_from_hf_path": str(ckpt), "lora": LORA})
    assert pending_pretrained(model) is not None and pending_lora(model) is not None
    assert [n for n in vars(model) if "pending" in n] == []
    with pytest.raises(RuntimeError, match="never loaded"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    model.init_weights()  # pretrained weights follow: zero-filled, not drawn
    assert all(not p.any() for p in model.parameters())
    model.load_after_sharding()
    assert pending_pretrained(model) is None and pending_lora(model) is None
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    ours = dict(model.named_parameters())
    for name, value in reference.named_parameters():
        base = name.replace("q_proj.weight", "q_proj.base_layer.weight")
        assert torch.equal(ours[base], value), name
    b = [v for n, v in ours.items() if "lora_B" in n]
    assert b and all(not v.any() for v in b)  # PEFT's initialisation: B is zero
    assert all(v.abs().sum() > 0 for n, v in ours.items() if "lora_A" in n)
    model(input_ids=torch.tensor([[1, 2, 3]]))  # the guard is gone


def test_the_tables_forget_a_collected_model(ckpt):
    with meta_parameters():
        model = TransformersModel({"init_from_hf_path": str(ckpt), "lora": LORA})
    ref = weakref.ref(model)
    gc.collect()  # other tests' unreachable models leave the tables now, not in the count below
    before = len(pending_weights._PRETRAINED), len(pending_weights._LORA)
    del model
    gc.collect()
    assert ref() is None  # the pending records hold no reference to their model
    assert (len(pending_weights._PRETRAINED), len(pending_weights._LORA)) == (before[0] - 1, before[1] - 1)


def test_nothing_is_pending_for_an_eagerly_built_model(ckpt):
    model = TransformersModel({"init_from_hf_path": str(ckpt), "lora": LORA})
    assert pending_pretrained(model) is None and pending_lora(model) is None
    assert pending_pretrained(object()) is None
