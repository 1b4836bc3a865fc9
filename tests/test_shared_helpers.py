"""The package's shared leaf helpers (one copy each), and the cases where the copies they replaced disagreed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mm._utils import safetensors_index as _safetensors
from lightning_mm._utils.distributed import local_tensor
from lightning_mm._utils.model_files import is_plain_file_name
from lightning_mm._utils.modules import (
    ROOT,
    enclosing,
    is_under,
    names_by_tensor,
    parameter_names_by_tensor,
    tied_parameter_names,
)
from lightning_mm._utils.suggestions import KEY_SHOWN, did_you_mean, find_unknown_key, listing, nearest


# ----------------------------------------------------------------------------------------------- _names
def test_nearest_compares_any_key_as_text_closest_first():
    assert nearest("hiden_size", ["hidden_size", "hidden_act", "vocab_size"]) == ["hidden_size", "hidden_act"]
    assert nearest("hiden_size", ["hidden_size", "hidden_act"], n=1) == ["hidden_size"]
    assert nearest(1, ["1x", "abc"]) == ["1x"]  # a YAML key may be an integer
    assert nearest("zzz", ["hidden_size"]) == []
    assert nearest("ab", ["abcd"], cutoff=0.5) == ["abcd"] and nearest("ab", ["abcd"], cutoff=0.7) == []


def test_did_you_mean_quotes_the_nearest_or_says_nothing():
    assert did_you_mean("lama", ["llama", "mistral"]) == "; did you mean 'llama'?"
    assert did_you_mean("qwen", ["qwen2", "qwen3", "llama"]) == "; did you mean 'qwen3', 'qwen2'?"
    assert did_you_mean("zzzz", ["llama"]) == ""


def test_find_unknown_key_names_the_first_unknown_key_with_a_hint():
    known = ["train", "validation", "loader"]
    assert find_unknown_key(["train", "loader"], known) is None
    assert find_unknown_key(["train", "trian", "lodaer"], known) == ("trian", "; did you mean `train`?")
    assert find_unknown_key(["batchsize"], ["batch_size"], prefix="loader.") == (
        "loader.batchsize",
        "; did you mean `loader.batch_size`?",
    )
    assert find_unknown_key(["zzzzzz"], known) == ("zzzzzz", "; valid keys: train, validation, loader")
    assert find_unknown_key([7], ["7"]) == ("7", "; did you mean `7`?")  # only strings are keys


def test_unknown_keys_are_cut_in_every_config_reader():
    """The model-side reader quoted an unknown key whole, the FSDP2 and data readers cut it: all cut it now."""
    from lightning_mm.hf.config_fields import checked_fields

    @dataclasses.dataclass
    class Fields:
        rank: int = 8

    long_key = "r" * 10_000
    shown, _ = find_unknown_key([long_key], ["rank"])
    assert shown == "r" * KEY_SHOWN
    with pytest.raises(ValueError) as err:
        checked_fields({long_key: 1}, Fields, "lora", ValueError)
    assert str(err.value) == f"unknown lora config key `{'r' * KEY_SHOWN}`; valid keys: rank"
    with pytest.raises(ValueError, match="did you mean `rank`"):
        checked_fields({"rnak": 1}, Fields, "lora", ValueError)


def test_a_non_string_hf_config_key_is_an_unknown_key():
    """TransformersModel's ``hf_config`` check raised TypeError (from ``hasattr``) on a key that is not a string;
    the other readers call it an unknown key, and so does it now."""
    pytest.importorskip("transformers")
    from lightning_mm.hf.transformers_model import TransformersModel, TransformersModelConfigError

    with pytest.raises(TransformersModelConfigError, match=r"`hf_config\.1`: LlamaConfig has no such key"):
        TransformersModel({"hf_config": {"model_type": "llama", 1: 8}})


def test_listing_shows_a_bounded_number_of_items():
    assert listing([], 3) == ""
    assert listing(["a", "b"], 3) == "a, b"
    assert listing(["a", "b", "c"], 3) == "a, b, c"
    assert listing(["a", "b", "c", "d", "e"], 3) == "a, b, c, ... and 2 more"
    assert listing([1, 2, 3], 1, sep="\n  ") == "1\n  ... and 2 more"


# ---------------------------------------------------------------------------------------- _module_paths
def test_is_under_follows_dotted_segments():
    assert is_under("layers.1", "layers.1")
    assert is_under("layers.1.mlp.up", "layers.1")
    assert not is_under("layers.10", "layers.1")
    assert not is_under("layers", "layers.1")
    assert not is_under("layers_norm", "layers")


def test_the_root_contains_every_module():
    """The plan (and hf_records) took the root path '' to contain everything, hf_plan, memory, LoRA and freeze
    only itself: the root contains everything."""
    assert is_under("lm_head", ROOT) and is_under("model.layers.0", ROOT) and is_under(ROOT, ROOT)
    assert not is_under(ROOT, "model")
    assert enclosing("model.layers.0", ["lm_head", ROOT]) == ROOT


def test_enclosing_is_the_first_ancestor_that_contains_the_path():
    assert enclosing("a.b.c", ["x", "a.b", "a"]) == "a.b"
    assert enclosing("a.bc", ["a.b"]) is None
    assert enclosing("a", []) is None


def test_pattern_suggestions_list_the_children_of_the_deepest_existing_path():
    """The suggestion fallback matched children with a bare ``startswith``: the children of 'layers.1' included
    those of 'layers.10'."""
    from lightning_mm.core.patterns import PatternError, resolve_pattern

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(2, 2)

    model = nn.Module()
    model.layers = nn.ModuleList(Layer() for _ in range(11))
    with pytest.raises(PatternError) as err:
        resolve_pattern(model, "layers.1." + "q" * 40)
    message = str(err.value)
    assert "closest existing paths: 'layers.1.attn'" in message
    assert "layers.10" not in message


# --------------------------------------------------------------------------------------------- _files
@pytest.mark.parametrize("name", ["model.safetensors", "model-00001-of-00002.safetensors", "..x", "a b"])
def test_plain_file_names(name):
    assert is_plain_file_name(name)


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", "/abs", "a\0b", None, 3, ["x"]])
def test_names_that_could_leave_the_directory(name):
    assert not is_plain_file_name(name)


# ---------------------------------------------------------------------------------------- _safetensors
_OLD_TABLES = {  # the three tables this one replaced: sliced loading, hf_to_dcp, the header check (sizes)
    "loading": ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"],
    "hf_to_dcp": ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"],
    "header": [
        "F64",
        "F32",
        "F16",
        "BF16",
        "I64",
        "I32",
        "I16",
        "I8",
        "U8",
        "BOOL",
        "F8_E4M3",
        "F8_E5M2",
        "U16",
        "U32",
        "U64",
    ],
}


def test_one_dtype_table_covers_every_old_one_and_agrees_with_safetensors():
    from safetensors.torch import _getdtype

    for names in _OLD_TABLES.values():
        assert set(names) <= set(_safetensors.DTYPES)
    for name, dtype in _safetensors.DTYPES.items():
        assert _getdtype(name) == dtype, name
        assert _safetensors.itemsize(name) == dtype.itemsize
    assert _safetensors.itemsize("F4") is None and "F4" not in _safetensors.DTYPES


def _hf_dir(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.bfloat16])
def test_every_reader_reads_the_dtypes_that_were_missing_from_one_table(tmp_path, dtype):
    """Sliced loading had no F8 and no U16/U32/U64 (it read them through ``safe_open``), hf_to_dcp refused
    U16/U32/U64: both now read what the header check accepts, with the same values."""
    from lightning_mm.hf.dcp_conversion import _HFTensors
    from lightning_mm.hf.loading import read_region
    from lightning_mm.hf.pretrained_index import SafetensorsIndex

    values = torch.arange(24, dtype=torch.float32).reshape(6, 4).to(dtype)
    directory = _hf_dir(tmp_path / "hf", {"w": values})
    info = SafetensorsIndex.from_directory(directory).tensors["w"]
    out = torch.empty(2, 4, dtype=dtype)
    with open(directory / info.file, "rb") as f:
        read_region(directory, {info.file: f}, info, (3, 0), (2, 4), out)
    assert torch.equal(out.view(torch.uint8), values[3:5].view(torch.uint8))
    hf = _HFTensors(directory)
    assert hf.dtypes["w"] == dtype and torch.equal(hf.get("w").view(torch.uint8), values.view(torch.uint8))


def _index(path: Path, weight_map: object) -> Path:
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def test_read_weight_map(tmp_path):
    index = _index(
        tmp_path / "model.safetensors.index.json",
        {"a": "one.safetensors", "b": "two.safetensors", "c": "one.safetensors"},
    )
    weight_map = _safetensors.read_weight_map(index)
    assert weight_map == {"a": "one.safetensors", "b": "two.safetensors", "c": "one.safetensors"}
    assert _safetensors.shard_files(weight_map) == ["one.safetensors", "two.safetensors"]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a safetensors index with a 'weight_map'"):
        _safetensors.read_weight_map(tmp_path / "bad.json")
    (tmp_path / "none.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(KeyError, match="not a safetensors index"):
        _safetensors.read_weight_map(tmp_path / "none.json", KeyError)


@pytest.mark.parametrize(
    "weight_map, match",
    [
        (["model.safetensors"], "not a safetensors index with a 'weight_map' \\(it is a list\\)"),
        ({"w": "../other/model.safetensors"}, "not a file of the checkpoint directory"),
        ({"w": "ABSOLUTE"}, "not a file of the checkpoint directory"),
        ({"w": 3}, "not a file of the checkpoint directory"),
    ],
)
def test_both_index_readers_refuse_what_one_of_them_accepted(tmp_path, weight_map, match):
    """``init_from_hf_path``'s reader followed any file name of the index (an absolute path, '..') and failed with
    AttributeError on a weight_map that is not a mapping; hf_to_dcp refused both. Both refuse them now."""
    from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError
    from lightning_mm.hf.dcp_conversion import _HFTensors
    from lightning_mm.hf.pretrained_index import CheckpointError, SafetensorsIndex

    other = _hf_dir(tmp_path / "other", {"w": torch.zeros(2)})
    if weight_map == {"w": "ABSOLUTE"}:
        weight_map = {"w": str(other / "model.safetensors")}
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _index(directory / "model.safetensors.index.json", weight_map)
    with pytest.raises(CheckpointError, match=match):
        SafetensorsIndex.from_directory(directory)
    with pytest.raises(CheckpointIntegrityError, match=match):
        _HFTensors(directory)


# ----------------------------------------------------------------------------------------------- _tied
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.body = nn.Linear(3, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(1))


def test_tied_parameters_are_grouped_by_object_identity():
    model = _Tied()
    assert tied_parameter_names(model) == [["embed.weight", "head.weight"]]
    groups = parameter_names_by_tensor(model)
    assert sorted(groups.values()) == [["body.bias"], ["body.weight"], ["embed.weight", "head.weight"]]
    assert groups[id(model.embed.weight)] == ["embed.weight", "head.weight"]
    state = names_by_tensor(model.state_dict(keep_vars=True).items())  # buffers too
    assert state[id(model.scale)] == ["scale"] and state[id(model.embed.weight)] == ["embed.weight", "head.weight"]


def test_tied_parameters_are_found_on_the_meta_device():
    with torch.device("meta"):
        model = _Tied()
    assert tied_parameter_names(model) == [["embed.weight", "head.weight"]]
    assert len(parameter_names_by_tensor(model)) == 3  # every meta tensor has the same (null) data pointer


def test_no_tied_parameters():
    assert tied_parameter_names(nn.Linear(2, 2)) == []


# --------------------------------------------------------------------------------------------- _dtensor
def test_local_tensor_of_a_plain_tensor_is_the_tensor():
    t = torch.ones(2)
    assert local_tensor(t) is t


def test_local_tensor_of_a_dtensor_is_its_local_shard(tmp_path):
    """On a real 1-rank gloo mesh, in a subprocess (no process group inside the test process)."""
    from tests.helpers.scenario_kit import read_results, run
    from tests.scenarios import dtensor_scenarios

    run(dtensor_scenarios.local_tensor_of_a_dtensor, tmp_path, timeout=120)
    assert read_results(tmp_path, "local_tensor_of_a_dtensor", ranks=1) == [{"plain_tensor": True, "equal": True}]


# ---------------------------------------------------------------------------------- _transformers_class
def test_transformers_class_is_the_model_class_behind_adapters_and_wrappers():
    transformers = pytest.importorskip("transformers")
    from lightning_mm._utils.modules import transformers_class
    from lightning_mm.hf.checkpoint_records import _architecture

    class Adapter(transformers.LlamaForCausalLM):
        pass

    class Wrapper:
        pass

    class FSDPAdapter(Wrapper, Adapter):  # as fully_shard derives a class: a base of its own first
        pass

    assert transformers_class(Adapter) is transformers.LlamaForCausalLM
    assert transformers_class(FSDPAdapter) is transformers.LlamaForCausalLM
    assert transformers_class(nn.Linear) is None
    assert _architecture(Adapter.__new__(Adapter)) == "LlamaForCausalLM"


def test_a_remote_code_model_is_named_by_its_own_class_not_by_a_generic_base():
    """hf_records' copy took the first class from any ``transformers.`` module, so a remote-code model (module
    ``transformers_modules.*``) was recorded as 'PreTrainedModel'; the load plan's copy wanted a model class from
    ``transformers.models``, and so do all now."""
    transformers = pytest.importorskip("transformers")
    from lightning_mm._utils.modules import transformers_class
    from lightning_mm.hf.checkpoint_records import _architecture

    remote = type("RemoteForCausalLM", (transformers.PreTrainedModel,), {"__module__": "transformers_modules.x"})
    assert transformers_class(remote) is None
    assert _architecture(remote.__new__(remote)) == "RemoteForCausalLM"


# ------------------------------------------------------------------------- accelerators.device_parsing
def test_npu_device_names_who_needs_an_npu_device():
    from lightning_mm.accelerators.device_parsing import npu_device

    # (without torch_npu, torch knows no "npu" device type: tests/test_npu.py covers the npu cases on its fake one)
    with pytest.raises(ValueError, match="^SingleNPUStrategy needs an npu device, got cpu$"):
        npu_device("cpu", "SingleNPUStrategy")


# ------------------------------------------------------------------------------ checkpoint conversion
def test_dcp_to_hf_key_mismatches_are_reported_by_one_check():
    from types import SimpleNamespace

    from lightning_mm.hf.dcp_conversion import _check_keys_match, _file_keys

    layout = SimpleNamespace(
        config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
        keys={"lm_head.weight": ["lm_head.weight", "model.embed_tokens.weight"], "b": ["b"]},
    )
    _check_keys_match("ckpt", layout, [], [])
    with pytest.raises(
        ValueError,
        match=r"^ckpt: the checkpoint's model keys do not match LlamaForCausalLM's: "
        r"1 missing \['b'\], 1 not in the model \['extra'\]$",
    ):
        _file_keys({"model.embed_tokens.weight": "k1", "extra": "k2"}, layout, "ckpt")
    assert _file_keys({"model.embed_tokens.weight": "k1", "b": "k2"}, layout, "ckpt") == {
        "lm_head.weight": "k1",
        "b": "k2",
    }


def test_info_messages_of_the_layers_below_lightning_are_shown_like_lightnings():
    """``rank_zero_info`` (the data readers' "no effect here" notes, checkpoint notes) reaches stderr in a process
    that configured no logging, as Lightning's own INFO messages do; an application that configured logging gets
    them through its own handlers, once."""
    import subprocess
    import sys

    code = "from lightning_mm._utils.distributed import rank_zero_info; rank_zero_info('a note for the user')"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert "a note for the user" in shown.stderr
    configured = "import logging; logging.basicConfig(format='app: %(message)s'); " + code
    app = subprocess.run([sys.executable, "-c", configured], capture_output=True, text=True, check=True, timeout=120)
    assert app.stderr.splitlines() == ["app: a note for the user"]
