"""The class a config names is the class built (issue #38, item 1).

A ModelHub adapter registered for a ``model_type`` applies only to the class it was written for: a config whose
``architectures[0]`` is another real Transformers class (``LlamaForSequenceClassification`` with
``model_type: llama``) is built as that class, with its pretrained weights; a name that is no class is a one-line
error naming ``architectures[0]``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_mm.hf.derived_adapters import resolve_model_class
from lightning_mm.modules import ModelHub, ModelHubError, TransformersModel

LLAMA = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
}


@pytest.mark.parametrize("arch", ["LlamaForSequenceClassification", "LlamaForTokenClassification"])
def test_architectures_0_is_the_class_built_not_the_model_type_adapter(arch, tmp_path):
    base = getattr(transformers, arch)
    torch.manual_seed(0)
    reference = base(transformers.LlamaConfig(num_labels=3, **LLAMA)).eval()
    reference.save_pretrained(tmp_path)
    assert reference.config.architectures == [arch] and reference.config.model_type == "llama"

    model = TransformersModel({"init_from_hf_path": str(tmp_path)}).eval()
    assert isinstance(model, base) and not isinstance(model, transformers.LlamaForCausalLM)
    ours, ref = model.state_dict(), reference.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
    ids = torch.tensor([[3, 5, 7, 9]])
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=0)
    # Without a directory: the same rule for a config defined by hf_config.
    built = TransformersModel({"hf_config": {"model_type": "llama", "architectures": [arch], **LLAMA}})
    assert type(built).__mro__[1] is base


def test_an_unknown_class_name_is_an_error_naming_architectures_0(tmp_path):
    config = {"architectures": ["LlamaForSomethingElse"], "model_type": "llama"}
    with pytest.raises(ModelHubError, match=r"architectures\[0\] 'LlamaForSomethingElse'") as err:
        resolve_model_class(None, config)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelHubError, match=r"architectures\[0\] 'LlamaForSomethingElse'"):
        TransformersModel({"hf_config": {**config, **LLAMA}})
    # A model_type known to Transformers but with no adapter: the auto class is used only when no class is named.
    with pytest.raises(ModelHubError, match=r"architectures\[0\] 'MistralForNothing'"):
        resolve_model_class(None, {"architectures": ["MistralForNothing"], "model_type": "mistral"})
    assert resolve_model_class(None, {"model_type": "mistral"})[0] == "MistralForCausalLM"


def test_the_model_type_adapter_still_serves_its_own_class_and_an_explicit_model_id_wins():
    adapter = ModelHub.get("llama")
    assert resolve_model_class(None, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})[1] is adapter
    assert resolve_model_class(None, {"model_type": "llama"})[1] is adapter
    assert ModelHub.serves(adapter, "LlamaForCausalLM") and ModelHub.serves(adapter, adapter.__name__)
    assert not ModelHub.serves(adapter, "LlamaForSequenceClassification")
    config = {"architectures": ["LlamaForSomethingElse"], "model_type": "llama"}
    assert resolve_model_class("llama", config)[1] is adapter  # the error's advice works
