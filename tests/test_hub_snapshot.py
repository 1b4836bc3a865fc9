"""`init_from_hf_path` and `convert hf-to-dcp` agree on directories (issue #38, item 5).

A Hugging Face hub-cache snapshot (``models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>``, the layout
``huggingface_hub`` downloads) loads in both; a link that leaves the snapshot's cache folder (or, for any other
directory, the directory) is refused by both, with the message of the one rule
(``lightning_mm._utils.model_files.model_file``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
import transformers

from lightning_mm.checkpoint.consolidate import dcp_to_torch
from lightning_mm.commands import convert_command as convert_cmd
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.hf.pending_weights import pending_pretrained
from lightning_mm.modules import TransformersModel

LLAMA = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _snapshot(plain: Path, cache: Path, revision: str = "0123abcd", folder: str = "") -> Path:
    """``plain``'s files as a hub-cache snapshot (in ``folder`` of it, as a diffusers pipeline keeps its
    ``transformer/``): every file a relative link into the repository's ``blobs/``."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision / folder
    snapshot.mkdir(parents=True)
    up = Path(*[".."] * (3 if folder else 2))
    for file in sorted(plain.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        (repo / "blobs" / digest).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(up / "blobs" / digest)
    return snapshot


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("plain")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.save_pretrained(directory, max_shard_size="20KB")  # sharded: an index and several files
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


def _convert(capsys, *args: str) -> tuple[int, str]:
    status = convert_cmd.main(list(args))
    return status, capsys.readouterr().err.strip()


@pytest.mark.parametrize("folder", ["", "transformer"])
def test_a_hub_cache_snapshot_loads_in_both(plain, tmp_path, capsys, folder):
    snapshot = _snapshot(plain, tmp_path / "hub", folder=folder)
    assert all(f.is_symlink() for f in snapshot.iterdir())
    reference = transformers.LlamaForCausalLM.from_pretrained(plain).state_dict()

    model = TransformersModel({"init_from_hf_path": str(snapshot)})
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    with meta_parameters():  # the strategy's path: headers checked now, shards read later
        assert pending_pretrained(TransformersModel({"init_from_hf_path": str(snapshot)})) is not None

    status, err = _convert(capsys, "hf-to-dcp", str(snapshot), str(tmp_path / "ck"))
    assert status == 0, err
    state = torch.load(dcp_to_torch(tmp_path / "ck", tmp_path / "ck.pt"), weights_only=True)["state_dict"]
    assert state.keys() == {f"model.{k}" for k in reference}
    assert all(torch.equal(state[f"model.{k}"], v) for k, v in reference.items())


@pytest.mark.parametrize("where", ["snapshot", "plain"])
def test_a_link_leaving_the_cache_folder_is_refused_by_both(plain, tmp_path, capsys, where):
    if where == "snapshot":
        directory = _snapshot(plain, tmp_path / "hub")
    else:
        directory = tmp_path / "copy"
        directory.mkdir()
        for file in plain.iterdir():
            (directory / file.name).write_bytes(file.read_bytes())
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = sorted(p.name for p in plain.iterdir() if p.suffix == ".safetensors")[0]
    (outside / shard).write_bytes((plain / shard).read_bytes())  # the same bytes, outside
    (directory / shard).unlink()
    os.symlink(outside / shard, directory / shard)

    with pytest.raises(ValueError, match=rf"{shard}: a symbolic link to .*elsewhere.*, outside") as err:
        TransformersModel({"init_from_hf_path": str(directory)})
    assert "\n" not in str(err.value)
    status, message = _convert(capsys, "hf-to-dcp", str(directory), str(tmp_path / "ck"))
    assert status == 1 and len(message.splitlines()) == 1
    assert f"{shard}: a symbolic link to" in message and "outside" in message
    assert not (tmp_path / "ck").exists()
    # The same for config.json.
    config = directory / "config.json"
    (outside / "config.json").write_bytes((plain / "config.json").read_bytes())
    config.unlink()
    os.symlink(outside / "config.json", config)
    with pytest.raises(ValueError, match=r"config.json: a symbolic link to .*, outside"):
        TransformersModel({"init_from_hf_path": str(directory)})
    status, message = _convert(capsys, "hf-to-dcp", str(directory), str(tmp_path / "ck"))
    assert status == 1 and "config.json: a symbolic link to" in message


def test_a_link_inside_a_plain_directory_is_followed_by_both(plain, tmp_path, capsys):
    directory = tmp_path / "linked"
    (directory / "store").mkdir(parents=True)
    for file in plain.iterdir():
        (directory / "store" / file.name).write_bytes(file.read_bytes())
        (directory / file.name).symlink_to(Path("store") / file.name)
    TransformersModel({"init_from_hf_path": str(directory)})
    status, err = _convert(capsys, "hf-to-dcp", str(directory), str(tmp_path / "ck"))
    assert status == 0, err
