"""One "is a norm layer" test (lightning_mm.core.norms.is_norm) for the plan, the default plans and weight
initialisation, checked on every module class of the tiny real models the tests train (all built on the meta
device from their tiny configs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mm.core.norms import is_norm

# Every norm class of the tiny models below; `True`: one of torch's, initialised to weight 1 / bias 0 by
# WeightInitMixin; `False`: the model's own class, initialised as its constructor does.
NORMS = {
    "FP32LayerNorm": True,  # diffusers' (Wan), a subclass of nn.LayerNorm
    "Gemma3RMSNorm": False,
    "Glm4vMoeRMSNorm": False,
    "Glm4vMoeTextRMSNorm": False,
    "Glm4vRMSNorm": False,
    "LayerNorm": True,
    "LlamaRMSNorm": False,
    "Mistral3RMSNorm": False,
    "MistralRMSNorm": False,
    "PixtralRMSNorm": False,
    "Qwen2_5OmniRMSNorm": False,
    "Qwen2_5_VLRMSNorm": False,
    "Qwen3VLTextRMSNorm": False,
    "Qwen3_5MoeRMSNorm": False,
    "Qwen3_5MoeRMSNormGated": False,  # the old default-plans test (a name ending in "Norm") missed this one
    "RMSNorm": True,
}


@pytest.fixture(scope="module")
def classes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, nn.Module]:
    import transformers
    from diffusers import WanTransformer3DModel

    from lightning_mm.testing.tiny_families import FAMILIES, write_tiny_family
    from lightning_mm.testing.tiny_qwen3_5 import tiny_qwen3_5_moe
    from lightning_mm.testing.tiny_vlms import FAMILIES as VLMS
    from lightning_mm.testing.tiny_vlms import write_tiny_vlm
    from tests.scenarios.wan_scenarios import TINY_WAN

    tmp = tmp_path_factory.mktemp("norms")
    directories: list[Path] = [write_tiny_vlm(tmp / f, f) for f in VLMS]
    directories += [write_tiny_family(tmp / f, f) for f in FAMILIES]
    directories.append(tiny_qwen3_5_moe(tmp / "qwen3_5"))
    found: dict[str, nn.Module] = {}
    with torch.device("meta"):
        models = [WanTransformer3DModel(**TINY_WAN)]
        for directory in directories:
            config = transformers.AutoConfig.from_pretrained(directory)
            models.append(getattr(transformers, config.architectures[0])(config))
    for model in models:
        for module in model.modules():
            found.setdefault(type(module).__name__, module)
    return found


def test_the_plan_the_default_plans_and_initialisation_ask_the_same_function() -> None:
    from lightning_mm.core import sharding_plan as plan
    from lightning_mm.hf import default_plans, mixins

    assert plan.is_norm is default_plans.is_norm is mixins.is_norm is is_norm


def test_is_norm_on_every_module_class_of_the_tiny_models(classes: dict[str, nn.Module]) -> None:
    assert {name for name, module in classes.items() if is_norm(module)} == set(NORMS)
    assert {name for name, module in classes.items() if is_norm(module, by_name=False)} == {
        name for name, torch_own in NORMS.items() if torch_own
    }
    # The plan's old rule ("Norm" anywhere in the class name, or a torch norm) agrees on every class.
    assert {n for n, m in classes.items() if "Norm" in n or isinstance(m, nn.LayerNorm)} == set(NORMS)


def test_initialisation_keeps_a_models_own_norm_as_its_constructor_makes_it() -> None:
    """Gemma's RMSNorm scales by ``1 + weight`` (its constructor makes the weight zero): initialisation does not
    set it to one as it does torch's norms (the name rule is not used there)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from lightning_mm.hf.mixins import init_module

    gemma, torch_norm = Gemma3RMSNorm(4), nn.LayerNorm(4)
    for norm in (gemma, torch_norm):
        norm.weight.data.fill_(0.5)
        init_module(norm)
    assert not torch.equal(gemma.weight, torch.ones(4)) and torch.equal(torch_norm.weight, torch.ones(4))
