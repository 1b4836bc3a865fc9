"""The one config-file loader (lightning_mm/_utils/yaml_io.py) through both configs that use it: hostile files are short
errors naming the file, ordinary files (anchors and aliases included) load as PyYAML's safe loader reads them."""

import json
from pathlib import Path

import pytest
import yaml

from lightning_mm import FSDP2Config
from lightning_mm._utils.yaml_io import MAX_ALIASES, MAX_BYTES, load_config, load_mapping
from lightning_mm.core.config import FSDP2ConfigError
from lightning_mm.data.data_config import DataConfig, DataConfigError
from tests.helpers.limits import bounded

ROOT = Path(__file__).resolve().parents[1]


def bomb(key: str) -> str:
    """About 300 bytes under one valid key that expand to 9**7 (4.8 million) strings: the old loader built the
    value (shared, so cheaply) and the error message quoted all of it, tens of MB."""
    items = [f"  - &a [{', '.join(['lol'] * 9)}]"]
    items += [f"  - &{name} [{', '.join([f'*{prev}'] * 9)}]" for prev, name in zip("abcde", "bcdef")]
    return f"{key}:\n" + "\n".join(items) + f"\n  - [{', '.join(['*f'] * 9)}]\n"


LOADERS = [
    pytest.param(FSDP2Config.from_yaml, FSDP2ConfigError, "sub_modules_to_wrap", id="fsdp2"),
    pytest.param(DataConfig.from_file, DataConfigError, "train", id="data"),
]


def write(tmp_path: Path, text: str | bytes, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize(("load", "error", "key"), LOADERS)
def test_alias_bomb_is_a_short_error_naming_the_file(tmp_path, load, error, key):
    path = write(tmp_path, bomb(key))
    assert len(path.read_bytes()) < 400
    with bounded(extra_bytes=1 << 30, seconds=20), pytest.raises(error, match="expands to more than") as err:
        load(path)
    assert str(path) in str(err.value) and len(str(err.value)) < 300


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: &a [*a]\n", "recursive anchor"),
        ("x: " + "[" * 200 + "]" * 200 + "\n", "nested more than"),
        ("x: &x 1\ny: [" + ", ".join(["*x"] * (MAX_ALIASES + 1)) + "]\n", f"more than {MAX_ALIASES} aliases"),
        ("sharding_size: " + "9" * 5000 + "\n", r":1: cannot read a value: Exceeds the limit"),
    ],
)
def test_other_hostile_yaml_is_a_short_error(tmp_path, text, message):
    path = write(tmp_path, text)
    with bounded(extra_bytes=1 << 30, seconds=20), pytest.raises(FSDP2ConfigError, match=message) as err:
        FSDP2Config.from_yaml(path)
    assert str(path) in str(err.value) and len(str(err.value)) < 400


def test_a_huge_file_is_refused_before_parsing(tmp_path):
    path = write(tmp_path, "# padding\n" * (MAX_BYTES // 10 + 1))
    with pytest.raises(FSDP2ConfigError, match="larger than 1024 KiB"):
        FSDP2Config.from_yaml(path)


@pytest.mark.parametrize(("load", "error", "key"), LOADERS)
def test_non_utf8_bytes_name_the_file_and_line(tmp_path, load, error, key):
    path = write(tmp_path, b"# a comment\n" + key.encode() + b": caf\xe9.jsonl\n")
    with pytest.raises(error, match=rf"{path}:2: not UTF-8 text \(byte 0xe9\)"):
        load(path)


@pytest.mark.parametrize(("load", "error", "key"), LOADERS)
@pytest.mark.parametrize("top", ["[]", "0", "false", "null", "- a\n- b", "just a string"])
def test_a_top_level_that_is_not_a_mapping_names_the_file(tmp_path, load, error, key, top):
    path = write(tmp_path, top + "\n")
    with pytest.raises(error, match=rf"{path}: the top level must be a mapping"):
        load(path)


@pytest.mark.parametrize(("load", "error", "key"), LOADERS)
def test_duplicate_keys_name_the_key_the_file_and_the_lines(tmp_path, load, error, key):
    path = write(tmp_path, f"{key}: [a]\nstrict: false\n{key}: [b]\n")
    with pytest.raises(error, match=rf"{path}:3: duplicate key '{key}' \(first on line 1\)"):
        load(path)
    nested = write(tmp_path, "loader:\n  batch_size: 2\n  batch_size: 4\n", "nested.yaml")
    with pytest.raises(DataConfigError, match=r"nested.yaml:3: duplicate key 'batch_size'"):
        DataConfig.from_file(nested)


def test_duplicate_keys_in_a_json_data_config(tmp_path):
    path = write(tmp_path, '{"train": "a.jsonl", "train": "b.jsonl"}', "data.json")
    with pytest.raises(DataConfigError, match=r"data.json: duplicate key 'train'"):
        DataConfig.from_file(path)
    deep = write(tmp_path, "[" * 100_000 + "]" * 100_000, "deep.json")
    with pytest.raises(DataConfigError, match="deep.json: nested too deeply"):
        DataConfig.from_file(deep)


def test_an_empty_fsdp2_config_means_all_defaults(tmp_path):
    assert FSDP2Config.from_yaml(write(tmp_path, "")) == FSDP2Config()
    assert FSDP2Config.from_yaml(write(tmp_path, "# only a comment\n", "c.yaml")) == FSDP2Config()


def test_anchors_aliases_and_merge_keys_still_work(tmp_path):
    path = write(tmp_path, "sub_modules_to_wrap: &blocks\n  - layers.{*}\n  - output\nrecompute_modules: *blocks\n")
    config = FSDP2Config.from_yaml(path)
    assert config.recompute_modules == config.sub_modules_to_wrap == ["layers.{*}", "output"]
    merged = write(
        tmp_path, "base: &b {batch_size: 2, shuffle: false}\nloader:\n  <<: *b\n  batch_size: 4\n", "merge.yaml"
    )
    assert load_mapping(merged)["loader"] == {"batch_size": 4, "shuffle": False}


def test_every_yaml_the_project_ships_reads_as_pyyaml_reads_it():
    files = sorted(ROOT.glob("examples/**/*.yaml"))
    assert len(files) >= 6
    for path in files:
        assert load_config(path) == yaml.safe_load(path.read_text()), path
        if path.name == "fsdp2_config.yaml":
            FSDP2Config.from_yaml(path)


def test_json_data_config_reads_as_json(tmp_path):
    data = {"train": "t.jsonl", "loader": {"batch_size": 2}}
    assert load_mapping(write(tmp_path, json.dumps(data), "data.json")) == data
