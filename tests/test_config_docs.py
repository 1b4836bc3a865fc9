"""The FSDP2 YAML keys are documented once, where FSDP2Config declares them, and docs/strategy.md shows exactly that."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import fields
from pathlib import Path

import pytest
import transformers

from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.patterns import resolve_patterns

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "strategy.md"


def _table_module():
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_yaml_key_has_its_docstring_where_it_is_declared():
    docs = _table_module().field_docs()
    keys = [f.name for f in fields(FSDP2Config)]
    assert list(docs) == keys
    assert [k for k in keys if not docs[k]] == []


def test_docs_table_is_the_generated_one():
    table = _table_module().table()
    text = DOC.read_text(encoding="utf-8")
    shown = text.split("<!-- yaml-keys:begin", 1)[1].split("-->", 1)[1].split("<!-- yaml-keys:end -->", 1)[0]
    assert shown.strip() == table, "docs/strategy.md is stale: run `python scripts/config_table.py --write`"
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.M))
    assert list(rows) == list(FSDP2Config().to_dict())
    # The defaults the migration guide's table states (the contract), as the page shows them.
    seed = {
        "sharding_size": "1",
        "use_reentrant": "true",
        "offload_to_cpu": "false",
        "pin_memory": "false",
        "num_to_backward_prefetch": "1",
    }
    assert {k: rows[k] for k in seed} == seed


def test_docs_yaml_example_loads_and_resolves_on_qwen2_5_vl(tmp_path):
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert block is not None
    path = tmp_path / "fsdp2_config.yaml"
    path.write_text(block.group(1))
    config = FSDP2Config.from_yaml(path)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32)
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    )
    for key in ("sub_modules_to_wrap", "recompute_modules"):
        assert resolve_patterns(model, getattr(config, key), key)
    with pytest.raises(ValueError):
        resolve_patterns(model, ["model.language_model.layer.{*}"], "sub_modules_to_wrap")
