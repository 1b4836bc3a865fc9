"""The parallel layout (lightning_mm.core.parallel_layout): sizes checked once against the world and the model, errors
naming
the key; the YAML keys and the strategy's alias."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.core.parallel_layout import LayoutError, config_layout, parallel_layout


def test_layout_sizes_and_mesh_names():
    lay = parallel_layout(8, "auto", tensor_parallel_size=2)
    assert (lay.dp, lay.dp_shard, lay.dp_replicate, lay.samplers) == (4, 4, 1, 4)
    assert lay.world_mesh_dim_names == ("shard", "tp") and lay.world_mesh_shape == (4, 2)
    hsdp = parallel_layout(8, 2, tensor_parallel_size=2)
    assert hsdp.world_mesh_dim_names == ("replicate", "shard", "tp") and hsdp.world_mesh_shape == (2, 2, 2)
    plain = parallel_layout(4, 2)  # as before: HSDP (replicate, shard) without TP
    assert plain.world_mesh_dim_names == ("replicate", "shard") and plain.world_mesh_shape == (2, 2)
    assert parallel_layout(4, 4, context_parallel_size=2).samplers == 2


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size"),
        (dict(context_parallel_size=3), "context_parallel_size"),
        (dict(expert_parallel_size=8), "expert_parallel_size"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(sharding_size=4, tensor_parallel_size=2), "sharding_size"),  # 4 data-parallel ranks... of 2
        (dict(tensor_parallel_size=2, context_parallel_size=4), "context_parallel_size"),  # 2 x 4 ranks of 4
    ],
)
def test_layout_errors_name_the_key(kwargs, key):
    with pytest.raises(LayoutError, match=f"`{key}`"):
        parallel_layout(4, **kwargs)


def test_layout_checks_the_model():
    lay = parallel_layout(4, "auto", tensor_parallel_size=4)
    ok = Qwen3Config(num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, vocab_size=128)
    lay.check_model(ok)
    for attr, value in (("num_key_value_heads", 2), ("num_attention_heads", 6), ("intermediate_size", 66)):
        bad = Qwen3Config(**{**ok.to_dict(), attr: value})
        with pytest.raises(LayoutError, match=f"`tensor_parallel_size`: 4 does not divide .*{attr} {value}"):
            lay.check_model(bad)


def test_yaml_keys_and_the_strategy_alias(tmp_path):
    path = tmp_path / "fsdp2.yaml"
    path.write_text("sharding_size: auto\ntensor_parallel_size: 2\ncontext_parallel_size: 1\n")
    config = FSDP2Config.from_yaml(path)
    assert config_layout(config, 4).tp == 2
    with pytest.raises(FSDP2ConfigError, match=f"`tensor_parallel_size` in {path}: 3 does not divide"):
        config_layout(FSDP2Config.from_dict({"tensor_parallel_size": 3}, source=str(path)), 4)
    with pytest.raises(FSDP2ConfigError, match="`context_parallel_size`: expected a positive integer"):
        FSDP2Config(context_parallel_size=0)
    assert FSDP2Config.load({"tensor_parallel_size": 2, "tp_plan": {"a.b": "rowwise"}}).tensor_parallel_size == 2
    cp = FSDP2Config(sharding_size="auto", context_parallel_size=2)
    assert config_layout(cp, 4).cp == 2 and config_layout(cp, 4, 2).cp == 2
    assert config_layout(FSDP2Config(sharding_size="auto"), 4, 2).cp == 2  # the strategy's argument alone
    with pytest.raises(FSDP2ConfigError, match="`context_parallel_size`: 2, but the strategy was given .*=4"):
        config_layout(cp, 4, 4)
    with pytest.raises(FSDP2ConfigError, match="`tp_plan`: only takes effect with `tensor_parallel_size` > 1"):
        FSDP2Config(tp_plan={"model.layers.*.mlp.up_proj": "colwise"})


def test_every_device_mesh_is_built_by_the_layout():
    """One mesh builder: no module but core/parallel_layout.py calls init_device_mesh or constructs a DeviceMesh."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "lightning_mm"
    builders = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if any(call in path.read_text(encoding="utf-8") for call in ("init_device_mesh(", "DeviceMesh("))
    ]
    assert builders == ["core/parallel_layout.py"]
