"""Qwen3-VL-MoE's default plan: the vision tower's units are dense Qwen3-VL's (patch and position embeddings, the
merger, each DeepStack merger), derived from the same metadata, so only the final norm stays in the root unit. Its
2-rank expert-parallel training against plain Transformers is in tests/test_expert_parallel.py."""

from __future__ import annotations

import torch
import transformers
import yaml

from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.core.sharding_plan import build_plan
from lightning_mm.hf.adapters import MMQwen3VLForConditionalGeneration, MMQwen3VLMoeForConditionalGeneration
from tests.helpers.moe_models import MOE_FAMILIES

VISION_UNITS = [
    "model.visual.patch_embed",
    "model.visual.pos_embed",
    "model.visual.merger",
    "model.visual.deepstack_merger_list.{*}",
]


def tiny_model_provider() -> torch.nn.Module:
    """A ``model_provider`` for LightningCLI configs: the adapter, random, from the tiny MoE config."""
    arch, kwargs = MOE_FAMILIES["qwen3_vl_moe"]
    config = getattr(transformers, arch).config_class(**kwargs)
    config.architectures = [arch]
    return MMQwen3VLMoeForConditionalGeneration(config)


def _meta_model() -> torch.nn.Module:
    with meta_parameters():
        return tiny_model_provider()


def test_the_vision_units_are_dense_qwen3_vls():
    for cls in (MMQwen3VLMoeForConditionalGeneration, MMQwen3VLForConditionalGeneration):  # both derived
        assert not hasattr(cls, "fsdp2_extra_units") and not hasattr(cls, "fsdp2_vision_towers")
    model = _meta_model()
    defaults = model.default_fsdp2_config()
    assert defaults["sub_modules_to_wrap"] == [
        "model.language_model.embed_tokens",
        "lm_head",
        *VISION_UNITS,
        "model.visual.blocks.{*}",
        "model.language_model.layers.{*}",
    ]
    assert defaults["moe_modules"] == [f"model.language_model.layers.{i}.mlp.experts" for i in range(2)]
    plan = build_plan(FSDP2Config(sharding_size="auto").with_model_defaults(model), model, 2)
    units = [u.modules for u in plan.units]
    for path in (
        "model.visual.patch_embed",
        "model.visual.pos_embed",
        "model.visual.merger",
        "model.visual.deepstack_merger_list.0",
        "model.visual.blocks.1",
        "model.language_model.layers.1",
    ):
        assert (path,) in units
    assert plan.root_params == 32  # the final norm (hidden 32), nothing of the vision tower


def test_plan_command_prints_the_vision_units(tmp_path):
    from lightning_mm.commands.plan_command import plan_from_cli_config

    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "mm_fsdp2", "logger": False},
        "model": {
            "class_path": "lightning_mm.MMLightningModule",
            "init_args": {"model_provider": "tests.test_qwen3_vl_moe_plan.tiny_model_provider"},
        },
        "data": {
            "class_path": "lightning_mm.MMDataModule",
            "init_args": {"train_valid_test_datasets_provider": "tests.helpers.qwen3_vl_family.datasets_provider"},
        },
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    text = plan_from_cli_config(["--config", str(path)], world_size=4)
    for unit in (
        "model.visual.patch_embed",
        "model.visual.pos_embed",
        "model.visual.merger",
        "model.visual.deepstack_merger_list.0",
        "model.language_model.layers.0",
    ):
        assert unit in text, text
    root = next(line for line in text.splitlines() if "<root>" in line)
    assert root.split()[1] == "32", root
