"""Hugging Face safetensors as a checkpoint format (``checkpoint_format="hf"`` / ``"torch_dcp+hf"``).

One 2-rank launch (tests/scenarios/ckpt_remote_scenarios.py ``hf``) trains a tiny Qwen3 and saves it as ``hf`` (through
ModelCheckpoint), resumes weights-only from that, saves ``torch_dcp+hf`` in bf16 and resumes exactly from it. Here:
the directories load with plain ``transformers.AutoModelForCausalLM.from_pretrained`` and hold the trained
weights under ``save_pretrained``'s names; the resumed states equal the saved ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lightning_mm import MMFSDP2Strategy
from lightning_mm.checkpoint import CheckpointIntegrityError, open_source
from lightning_mm.checkpoint.hf_weights import INDEX_FILE
from tests.helpers.scenario_kit import run
from tests.scenarios import ckpt_remote_scenarios


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("hf_format")
    run(ckpt_remote_scenarios.hf, work)
    return work


def _state(work: Path, name: str) -> dict:
    return torch.load(work / name, weights_only=True)


def _safetensors_keys(directory: Path) -> set[str]:
    keys: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            keys |= set(f.keys())
    return keys


def test_an_hf_checkpoint_loads_with_from_pretrained_and_holds_the_trained_weights(work, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from tests.scenarios.ckpt_remote_scenarios import tiny_qwen3_config

    directory = work / "hf" / "step=2.ckpt"
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    ref = _state(work, "hf_ref.pt")["model"]
    loaded = model.state_dict()
    assert loaded and {f"model.{k}" for k in loaded} == set(ref)
    for key, value in loaded.items():
        assert torch.equal(value, ref[f"model.{key}"]), key
    Qwen3ForCausalLM(tiny_qwen3_config()).save_pretrained(tmp_path / "reference")
    assert _safetensors_keys(directory) == _safetensors_keys(tmp_path / "reference")  # save_pretrained's names


def test_resuming_from_an_hf_checkpoint_is_weights_only_and_says_so(work):
    out = json.loads((work / "hf.rank0.json").read_text())["weights_only"]
    assert out["start"] == 0
    assert any("holds model weights only" in w and "fresh optimiser" in w for w in out["warnings"])
    ref, loaded = _state(work, "hf_ref.pt"), _state(work, "hf_loaded.pt")
    for key, value in ref["model"].items():
        assert torch.equal(loaded["model"][key], value), key


def test_torch_dcp_plus_hf_holds_bf16_safetensors_and_resumes_exactly_from_its_dcp_part(work):
    from transformers import AutoModelForCausalLM

    directory = work / "both.ckpt"
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(directory / "model-00001-of-00001.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # written in bf16, not cast on load
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    ref = _state(work, "both_ref.pt")
    for key, value in model.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, ref["model"][f"model.{key}"].bfloat16()), key
    assert json.loads((work / "hf.rank0.json").read_text())["exact"]["start"] == 3
    loaded = _state(work, "both_loaded.pt")
    for key, value in ref["model"].items():
        assert torch.equal(loaded["model"][key], value), key  # fp32, from the DCP part
    for saved, back in zip(ref["optimizers"], loaded["optimizers"]):
        for name, entries in saved["state"].items():
            for k, v in entries.items():
                assert torch.equal(back["state"][name][k], v), (name, k)


def test_hf_format_folders_hold_exactly_their_files_and_none_is_empty(work):
    """A rank with nothing to write through DCP writes no shard file: an ``hf`` checkpoint keeps no model or
    optimiser tensors in DCP, so it holds no ``.distcp`` file at all (it held one 0-byte file per rank)."""
    hf_side = {"config.json", "generation_config.json", "model-00001-of-00001.safetensors", INDEX_FILE}
    for directory, distcp in (
        (work / "hf" / "step=2.ckpt", set()),
        (work / "both.ckpt", {"__0_0.distcp", "__1_0.distcp"}),
    ):
        sizes = {p.name: p.stat().st_size for p in directory.iterdir()}
        assert sorted(name for name, size in sizes.items() if size == 0) == [], directory
        assert set(sizes) == {".metadata", "meta.pt", "manifest.json", *hf_side, *distcp}, directory
        assert set(json.loads((directory / "manifest.json").read_text())["files"]) == set(sizes) - {"manifest.json"}


def test_an_altered_safetensors_file_of_an_hf_checkpoint_is_refused(work, tmp_path):
    copy = tmp_path / "step=2.ckpt"
    shutil.copytree(work / "hf" / "step=2.ckpt", copy)
    weights = copy / "model-00001-of-00001.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0x40
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match="model-00001-of-00001.safetensors: its content differs"):
        open_source(copy)
    (copy / "extra.safetensors").write_bytes(b"")
    weights.write_bytes((work / "hf" / "step=2.ckpt" / weights.name).read_bytes())
    with pytest.raises(CheckpointIntegrityError, match="extra.safetensors: not part of this checkpoint"):
        open_source(copy)


def test_save_ckpt_dtype_is_checked():
    with pytest.raises(ValueError, match="save_ckpt_dtype must be one of"):
        MMFSDP2Strategy(checkpoint_format="hf", save_ckpt_dtype="int8")
    with pytest.raises(ValueError, match="needs checkpoint_format 'hf' or 'torch_dcp\\+hf', not 'torch_dcp'"):
        MMFSDP2Strategy(save_ckpt_dtype="bf16")
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        MMFSDP2Strategy(checkpoint_format="safetensors")


def test_the_names_are_save_pretrained_ones_and_what_has_none_is_refused():
    from torch import nn
    from transformers import Qwen3ForCausalLM

    from lightning_mm.hf.checkpoint_format import plan_weights
    from tests.scenarios.ckpt_remote_scenarios import tiny_qwen3_config

    root = nn.Module()
    root.model = Qwen3ForCausalLM(tiny_qwen3_config())
    fqns = list(root.state_dict())
    weights = plan_weights(root, fqns)
    assert "model.lm_head.weight" in fqns and "model.lm_head.weight" not in weights.keys  # tied: stored once
    assert weights.keys["model.model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert set(weights.keys.values()) == set(root.model.state_dict()) - {"lm_head.weight"}
    root.head = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"2 model tensor\(s\) are outside the Qwen3ForCausalLM model .*head.weight"):
        plan_weights(root, list(root.state_dict()))
    plain = nn.Sequential(nn.Linear(2, 2))
    assert plan_weights(plain, list(plain.state_dict())).keys == {"0.weight": "0.weight", "0.bias": "0.bias"}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_a_tiny_vlm_in_the_hf_format_loads_with_from_pretrained(family, tmp_path):
    """One process: the VLM's in-memory names (e.g. LLaVA's ``model.language_model.*``) are written under
    ``save_pretrained``'s, and the directory (with the processor files) loads as the original."""
    import transformers
    from torch import nn

    from lightning_mm.hf.checkpoint_format import plan_weights
    from lightning_mm.hf.dcp_conversion import side_files
    from lightning_mm.testing.tiny_vlms import FAMILIES, write_tiny_vlm

    source = write_tiny_vlm(tmp_path / "source", family)
    cls = getattr(transformers, FAMILIES[family]["model"])
    root = nn.Module()
    root.model = cls.from_pretrained(source)
    state = root.state_dict()
    weights = plan_weights(root, list(state))
    out = tmp_path / "ckpt"
    out.mkdir()
    written = weights.writer(state, None)(out)
    sides = {p.name for p in side_files(source) if len(p.parts) == 1}
    assert not (out / "sharded").exists() and "tokenizer_config.json" in sides
    assert {p.name for p in written} >= sides | {"config.json", "model.safetensors.index.json"}
    assert _safetensors_keys(out) == _safetensors_keys(source)
    back = cls.from_pretrained(out)
    for key, value in root.model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert (
        transformers.AutoTokenizer.from_pretrained(out).get_vocab()
        == transformers.AutoTokenizer.from_pretrained(source).get_vocab()
    )
