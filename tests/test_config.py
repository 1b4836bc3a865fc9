"""FSDP2Config: loading from YAML, dict and Python, and strict validation that names the key."""

from pathlib import Path

import pytest
import torch

from lightning_mm import FSDP2Config
from lightning_mm.core.config import FSDP2ConfigError

SEED_YAML = Path(__file__).resolve().parents[1] / "examples" / "custom_model" / "fsdp2_config.yaml"


def test_seed_yaml_loads_verbatim():
    config = FSDP2Config.from_yaml(SEED_YAML)
    assert config.sharding_size == "auto"
    assert config.sub_modules_to_wrap == [
        "text_decoder.output_layer",
        "text_decoder.embedding",
        "text_decoder.rotary_pos_emb",
        "text_decoder.decoder.layers.{*}",
    ]
    assert config.param_dtype is torch.bfloat16 and config.reduce_dtype is torch.float32
    assert config.output_dtype is None and config.cast_forward_inputs is True
    assert config.ignored_modules == ["image_encoder"]
    assert config.recompute_modules == ["text_decoder.decoder.layers.{*}"]
    assert config.num_to_forward_prefetch == 2 and config.num_to_backward_prefetch == 2
    assert config.offload_to_cpu is False
    assert config.source == str(SEED_YAML)


def test_seed_defaults():
    config = FSDP2Config()
    assert config.sharding_size == 1
    assert config.use_reentrant is True
    assert config.offload_to_cpu is False and config.pin_memory is False
    assert config.num_to_backward_prefetch == 1
    assert config.param_dtype is None


def test_dict_python_and_yaml_agree(tmp_path):
    data = {
        "sharding_size": 2,
        "param_dtype": "bfloat16",
        "reduce_dtype": "torch.float32",
        "sub_modules_to_wrap": ["layers.{0-3,7}"],
        "reshard_after_forward": False,
    }
    path = tmp_path / "c.yaml"
    path.write_text(
        "sharding_size: 2\nparam_dtype: bfloat16\nreduce_dtype: torch.float32\n"
        "sub_modules_to_wrap: ['layers.{0-3,7}']\nreshard_after_forward: false\n"
    )
    from_dict = FSDP2Config.from_dict(data)
    from_yaml = FSDP2Config.from_yaml(path)
    built = FSDP2Config(
        sharding_size=2,
        param_dtype=torch.bfloat16,
        reduce_dtype="fp32",
        sub_modules_to_wrap=["layers.{0-3,7}"],
        reshard_after_forward=False,
    )
    assert from_dict == from_yaml == built
    assert FSDP2Config.from_dict(built.to_dict()) == built
    assert FSDP2Config.load(path) == built and FSDP2Config.load(data) == built and FSDP2Config.load(built) is built


def test_typo_is_an_error_that_suggests_the_key_and_names_the_file(tmp_path):
    path = tmp_path / "fsdp2_config.yaml"
    path.write_text("sharding_size: auto\nsub_module_to_wrap:\n  - layers.{*}\n")
    with pytest.raises(
        FSDP2ConfigError,
        match=r"unknown FSDP2 config key `sub_module_to_wrap`.*fsdp2_config.yaml"
        r".*did you mean `sub_modules_to_wrap`",
    ):
        FSDP2Config.from_yaml(path)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"sharding_size": 0}, "sharding_size"),
        ({"sharding_size": -2}, "sharding_size"),
        ({"sharding_size": "all"}, "sharding_size"),
        ({"sharding_size": True}, "sharding_size"),
        ({"sharding_size": 1.5}, "sharding_size"),
        ({"param_dtype": "bf8"}, "param_dtype"),
        ({"reduce_dtype": "int8"}, "reduce_dtype"),
        ({"output_dtype": 16}, "output_dtype"),
        ({"cast_forward_inputs": "yes"}, "cast_forward_inputs"),
        ({"use_reentrant": 1}, "use_reentrant"),
        ({"sub_modules_to_wrap": [1, 2]}, "sub_modules_to_wrap"),
        ({"ignored_modules": {"a": 1}}, "ignored_modules"),
        ({"num_to_forward_prefetch": -1}, "num_to_forward_prefetch"),
        ({"num_to_backward_prefetch": "2"}, "num_to_backward_prefetch"),
        ({"pin_memory": True}, "pin_memory"),
        ({"recompute_modules": ["layers.{1-}"]}, "recompute_modules"),
        ({"sub_modules_to_wrap": ["layers.{0-3"]}, "sub_modules_to_wrap"),
        ({"sub_modules_to_wrap": ["layers{0-3}"]}, "sub_modules_to_wrap"),
        ({"sub_modules_to_wrap": ["layers.{5-2}"]}, "sub_modules_to_wrap"),
        ({"sub_modules_to_wrap": ["layers..0"]}, "sub_modules_to_wrap"),
    ],
)
def test_bad_values_name_the_key(data, key):
    with pytest.raises(FSDP2ConfigError, match=f"`{key}`"):
        FSDP2Config.from_dict(data)


def test_pin_memory_with_offload_is_fine():
    assert FSDP2Config(offload_to_cpu=True, pin_memory=True).pin_memory


def test_yaml_uses_a_safe_loader(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("sharding_size: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(FSDP2ConfigError, match="not valid YAML"):
        FSDP2Config.from_yaml(path)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        FSDP2Config.from_yaml(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(FSDP2ConfigError, match="mapping"):
        FSDP2Config.from_yaml(path)


def test_sharding_size_must_divide_world():
    assert FSDP2Config(sharding_size="auto").resolve_sharding_size(8) == 8
    assert FSDP2Config(sharding_size=4).resolve_sharding_size(8) == 4
    with pytest.raises(FSDP2ConfigError, match="`sharding_size`.*3 does not divide the world size 8"):
        FSDP2Config(sharding_size=3).resolve_sharding_size(8)
    with pytest.raises(FSDP2ConfigError, match="`sharding_size`"):
        FSDP2Config(sharding_size=16).resolve_sharding_size(8)


def test_model_defaults_fill_only_unset_keys():
    class Adapted:
        def default_fsdp2_config(self):
            return {"sub_modules_to_wrap": ["layers.{*}"], "recompute_modules": ["layers.{*}"], "sharding_size": 2}

    config = FSDP2Config(recompute_modules=["layers.0"], sharding_size="auto").with_model_defaults(Adapted())
    assert config.sub_modules_to_wrap == ["layers.{*}"]
    assert config.recompute_modules == ["layers.0"] and config.sharding_size == "auto"

    class Bad:
        def default_fsdp2_config(self):
            return {"sub_module_to_wrap": []}

    with pytest.raises(FSDP2ConfigError, match="sub_module_to_wrap"):
        FSDP2Config().with_model_defaults(Bad())
