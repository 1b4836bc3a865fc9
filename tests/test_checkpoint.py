"""Checkpoint building blocks in one process (no process group): layout, safety, atomicity, store, RNG, converters.

The distributed behaviour (2 ranks, resume, resharding, crash) is in tests/test_checkpoint_dist.py.
"""

from __future__ import annotations

import os
import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lightning_mm.checkpoint import atomic, consolidate, manifest, store
from lightning_mm.checkpoint.checkpoint_layout import (
    MARKER,
    CheckpointKeyError,
    fill_tensors,
    plan_keys,
    pop_loader_states,
    put_loader_states,
    split_tensors,
)
from lightning_mm.checkpoint.rng import capture_rng, restore_rng
from lightning_mm.checkpoint.safe import UnsafeCheckpointError, check_weights_only, read_dcp_metadata
from lightning_mm.commands import convert_command as convert_cmd
from lightning_mm.hf import dcp_conversion as convert
from lightning_mm.hf.checkpoint_records import hf_records

EXTRA = {"format_version": 1, "kind": "training", "world_size": 1, "rng_point": "next_batch", "hf": []}


class Net(nn.Module):
    def __init__(self, head: str = "head") -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.add_module(head, nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return next(m for n, m in self.named_children() if n != "body")(self.body(x))


def _trained(seed: int = 0, head: str = "head") -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net(head)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _lightning_dict(net: Net, opt: torch.optim.Optimizer, full: bool = False) -> dict:
    return {
        "epoch": 0,
        "global_step": 2,
        "pytorch-lightning_version": "2.6",
        "state_dict": store.model_state(net, full),
        "optimizer_states": [store.optimizer_state(net, opt, full)],
        "lr_schedulers": [],
        "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"yielded": 2}]}}},
    }


# ------------------------------------------------------------------------------------------- layout
def test_split_and_fill_round_trip_and_per_rank_loader_state():
    tree = {
        "state_dict": {"a.w": torch.ones(2)},
        "optimizer_states": [
            {
                "state": {"a.w": {"step": torch.tensor(1.0), "note": "x"}},
                "param_groups": [{"lr": 0.1, "params": ["a.w"]}],
            }
        ],
        "epoch": 3,
    }
    meta, tensors = split_tensors(tree)
    assert set(tensors) == {"state_dict/a.w", "optimizer_states/0/state/a.w/step"}
    assert meta["state_dict"]["a.w"] == {MARKER: "state_dict/a.w"} and meta["epoch"] == 3
    assert meta["optimizer_states"][0]["state"]["a.w"]["note"] == "x"
    back = fill_tensors(meta, tensors.__getitem__)
    assert torch.equal(back["state_dict"]["a.w"], tree["state_dict"]["a.w"]) and back["epoch"] == 3
    ckpt = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [{"yielded": 4}]}}}}
    assert pop_loader_states(ckpt) == [{"yielded": 4}] and ckpt["loops"]["fit_loop"]["state_dict"] == {}
    put_loader_states(ckpt, [{"yielded": 5}])
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"yielded": 5}]


def test_plan_keys_aliases_missing_unexpected_and_shapes():
    expected = {"emb.w": (4, 2), "out.w": (4, 2), "b": (3,), "c": (1,)}
    stored = {"emb.w": (4, 2), "b": (2,), "z": (1,)}
    plan = plan_keys(expected, stored, aliases=[["emb.w", "out.w"]])
    assert plan.load == {"emb.w": "emb.w"}  # the tied out.w is satisfied through emb.w
    assert plan.missing == ["c"] and plan.unexpected == ["z"] and plan.mismatched == [("b", (2,), (3,))]
    text = plan.describe("model")
    assert "missing from the checkpoint: c" in text and "unexpected in the checkpoint: z" in text
    assert "b (checkpoint [2], model [3])" in text


# ------------------------------------------------------------------------------------------- safety
class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _forge_manifest(directory: Path) -> None:
    """An attacker who writes files can rewrite the manifest too: the unpickler, not the manifest, must hold."""
    manifest.write_manifest(directory, [], [p.name for p in directory.iterdir() if p.name != "manifest.json"])


def test_crafted_dcp_metadata_and_meta_file_are_refused_without_running_code(tmp_path):
    net, opt = _trained()
    store.save(_lightning_dict(net, opt), tmp_path / "c.ckpt", "torch_dcp", EXTRA, None)
    assert read_dcp_metadata(tmp_path / "c.ckpt").state_dict_metadata  # the genuine one reads fine
    marker = tmp_path / "pwned"
    (tmp_path / "c.ckpt" / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    _forge_manifest(tmp_path / "c.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="refusing to load posix.system"):
        store.open_source(tmp_path / "c.ckpt")
    store.save(_lightning_dict(net, opt), tmp_path / "d.ckpt", "torch_dcp", EXTRA, None)
    torch.save({"x": _Evil(str(marker))}, tmp_path / "d.ckpt" / "meta.pt")
    _forge_manifest(tmp_path / "d.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        store.open_source(tmp_path / "d.ckpt")
    assert not marker.exists()


def test_unsafe_values_fail_the_save_before_anything_is_written(tmp_path):
    net, opt = _trained()
    ckpt = _lightning_dict(net, opt) | {"hyper_parameters": {"ok": 1, "config": _Evil("x")}}
    with pytest.raises(ValueError, match=r"hyper_parameters\.config"):
        store.save(ckpt, tmp_path / "c.ckpt", "torch_dcp", EXTRA, None)
    assert list(tmp_path.iterdir()) == []
    check_weights_only({"a": [1, 2.0, "s", None, torch.zeros(1), (3, 4)]})  # plain values pass


# ----------------------------------------------------------------------------------------- atomicity
@pytest.mark.parametrize("exchange", [True, False])
def test_commit_replaces_a_checkpoint_directory_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the portable path
    final = tmp_path / "last.ckpt"
    final.mkdir()
    (final / "old").write_text("old")
    partial = atomic.partial_path(final)
    partial.mkdir()
    (partial / "new").write_text("new")
    assert atomic.stale_partials(final) == [partial]
    atomic.commit(partial, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert [p.name for p in final.iterdir()] == ["new"]


def test_commit_over_a_link_replaces_the_link_not_its_target_and_remove_hides_first(tmp_path):
    target = tmp_path / "step=2.ckpt"
    target.mkdir()
    (target / "data").write_text("2")
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    partial = atomic.partial_path(link)
    partial.mkdir()
    atomic.commit(partial, link)
    assert not link.is_symlink() and link.is_dir() and (target / "data").read_text() == "2"
    atomic.remove(target)
    atomic.remove(link)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------- store
@pytest.mark.parametrize("fmt", ["torch_dcp", "torch"])
def test_save_and_load_round_trip_restores_weights_optimizer_loader_and_rng(tmp_path, fmt):
    net, opt = _trained(0)
    rng = capture_rng()
    path = tmp_path / ("c.ckpt" if fmt == "torch_dcp" else "c.pt")
    store.save(_lightning_dict(net, opt, full=fmt == "torch"), path, fmt, EXTRA, rng)
    assert path.is_dir() == (fmt == "torch_dcp") and atomic.stale_partials(path) == []
    other, other_opt = _trained(1)
    loaded = store.load(path, other, [other_opt], strict=True, rank=0, world_size=1, fitting=True)
    for (name, a), b in zip(net.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(net.parameters(), other.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], other_opt.state[q][key])
    assert loaded.checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"yielded": 2}]
    assert torch.equal(loaded.rng["torch"], rng["torch"]) and loaded.rng_point == "next_batch"
    assert "optimizer_states" not in loaded.checkpoint and loaded.checkpoint["global_step"] == 2


def test_strict_load_lists_keys_non_strict_loads_the_rest_and_reports(tmp_path):
    net, opt = _trained(0)
    store.save(_lightning_dict(net, opt), tmp_path / "c.ckpt", "torch_dcp", EXTRA, None)
    renamed, renamed_opt = _trained(1, head="out")
    fresh_out = renamed.out.weight.detach().clone()
    with pytest.raises(CheckpointKeyError) as info:
        store.load(tmp_path / "c.ckpt", renamed, [renamed_opt], strict=True, rank=0, world_size=1, fitting=True)
    assert "missing from the checkpoint: out.weight, out.bias" in str(info.value)
    assert "unexpected in the checkpoint: head.weight, head.bias" in str(info.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = store.load(
            tmp_path / "c.ckpt", renamed, [renamed_opt], strict=False, rank=0, world_size=1, fitting=True
        )
    messages = [str(w.message) for w in caught]
    assert any("Non-strict" in m and "out.weight" in m for m in messages)
    assert "head.weight" in loaded.skipped and "out.weight" in loaded.skipped
    assert torch.equal(renamed.body.weight, net.body.weight) and torch.equal(renamed.out.weight, fresh_out)
    assert renamed.out.weight not in renamed_opt.state  # its optimiser state starts fresh


def test_a_prefix_mismatch_fails_even_when_non_strict(tmp_path):
    net, opt = _trained(0)
    store.save(_lightning_dict(net, opt), tmp_path / "c.ckpt", "torch_dcp", EXTRA, None)
    wrapper = nn.Module()
    wrapper.model = Net()
    with pytest.raises(CheckpointKeyError, match="no model key of the checkpoint matches"):
        store.load(tmp_path / "c.ckpt", wrapper, [], strict=False, rank=0, world_size=1, fitting=False)


def test_bad_checkpoints_fail_with_the_reason(tmp_path):
    net, opt = _trained(0)
    weights = {k: v for k, v in _lightning_dict(net, opt).items() if k not in ("optimizer_states", "lr_schedulers")}
    store.save(weights, tmp_path / "w.ckpt", "torch_dcp", EXTRA, None)
    store.load(tmp_path / "w.ckpt", Net(), [], strict=True, rank=0, world_size=1, fitting=False)  # fine to evaluate
    with pytest.raises(ValueError, match="holds no optimizer state"):
        store.load(tmp_path / "w.ckpt", net, [opt], strict=True, rank=0, world_size=1, fitting=True)
    store.save(_lightning_dict(net, opt), tmp_path / "new.ckpt", "torch_dcp", EXTRA | {"format_version": 99}, None)
    with pytest.raises(ValueError, match="newer lightning-mm"):
        store.load(tmp_path / "new.ckpt", net, [opt], strict=True, rank=0, world_size=1, fitting=True)
    (tmp_path / "half.ckpt").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete torch_dcp checkpoint"):
        store.open_source(tmp_path / "half.ckpt")
    with pytest.raises(ValueError, match="other format"):
        store.save(_lightning_dict(net, opt), tmp_path / "new.ckpt", "torch", EXTRA, None)


def test_rng_states_round_trip():
    state = capture_rng()
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    restore_rng(state)
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


# ---------------------------------------------------------------------------------------- converters
def _tiny_llama(tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=tie,
        )
    )


def test_hf_record_names_prefix_and_hugging_face_class_of_an_adapter():
    from transformers import LlamaForCausalLM

    from lightning_mm.modules import FSDP2Mixin

    class Adapter(LlamaForCausalLM, FSDP2Mixin):
        pass

    wrapper = nn.Module()
    wrapper.model = Adapter(_tiny_llama().config)
    (record,) = hf_records(wrapper)
    assert record["prefix"] == "model." and record["architecture"] == "LlamaForCausalLM"
    assert '"architectures": ["LlamaForCausalLM"]' in record["config"]
    assert hf_records(Net()) == []


def test_converters_round_trip_in_one_process(tmp_path):
    from transformers import LlamaForCausalLM

    wrapper = nn.Module()
    wrapper.model = _tiny_llama()
    opt = torch.optim.AdamW(wrapper.parameters())
    ckpt = {
        "epoch": 0,
        "global_step": 0,
        "state_dict": store.model_state(wrapper, False),
        "optimizer_states": [store.optimizer_state(wrapper, opt, False)],
    }
    store.save(ckpt, tmp_path / "c.ckpt", "torch_dcp", EXTRA | {"hf": hf_records(wrapper)}, None)
    # dcp -> torch: full tensors in Lightning's layout, loadable weights-only.
    consolidate.dcp_to_torch(tmp_path / "c.ckpt", tmp_path / "c.pt", model_only=True)
    full = torch.load(tmp_path / "c.pt", weights_only=True)
    assert "optimizer_states" not in full
    for key, value in wrapper.state_dict().items():
        assert torch.equal(full["state_dict"][key], value), key
    # dcp -> hf (bf16, several shards) -> from_pretrained.
    convert.dcp_to_hf(tmp_path / "c.ckpt", tmp_path / "hf", dtype="bf16", max_shard_size=convert.parse_size("4KB"))
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for key, value in wrapper.model.state_dict().items():
        assert torch.equal(hf[key].float(), value.to(torch.bfloat16).float()), key
    # hf -> dcp loads back into the wrapper (strict), aliases included.
    convert.hf_to_dcp(tmp_path / "hf", tmp_path / "back.ckpt")
    other = nn.Module()
    other.model = _tiny_llama()
    torch.nn.init.zeros_(other.model.lm_head.weight)
    store.load(tmp_path / "back.ckpt", other, [], strict=True, rank=0, world_size=1, fitting=False)
    for key, value in other.state_dict().items():
        assert torch.equal(value, hf[key[len("model.") :]].to(value.dtype)), key


def test_convert_cli_reports_bad_input_clearly(tmp_path, capsys):
    assert convert_cmd.main(["dcp-to-torch", str(tmp_path / "nope"), str(tmp_path / "out.pt")]) == 1
    assert "checkpoint not found" in capsys.readouterr().err
    net, opt = _trained()
    store.save(_lightning_dict(net, opt), tmp_path / "c.ckpt", "torch_dcp", EXTRA, None)
    assert convert_cmd.main(["dcp-to-hf", str(tmp_path / "c.ckpt"), str(tmp_path / "hf")]) == 1
    assert "records no Hugging Face model" in capsys.readouterr().err
    assert convert_cmd.main(["dcp-to-torch", str(tmp_path / "c.ckpt"), str(tmp_path / "c.ckpt")]) == 1
    assert "output exists" in capsys.readouterr().err
    (tmp_path / "hfdir").mkdir()
    assert convert_cmd.main(["hf-to-dcp", str(tmp_path / "hfdir"), str(tmp_path / "x.ckpt")]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert convert_cmd.main(["dcp-to-torch", str(tmp_path / "c.ckpt"), str(tmp_path / "c.pt")]) == 0
    assert Path(tmp_path / "c.pt").is_file()


def test_hf_to_dcp_renames_keys_as_transformers_does_on_load(tmp_path):
    # LLaVA checkpoints keep `language_model.model.*`-style keys that Transformers renames when loading; the DCP
    # checkpoint must use the module's keys so that a strict resume accepts it.
    from tests.scenarios.hf_scenarios import save_tiny_checkpoints, tiny_hf_model

    path = save_tiny_checkpoints(tmp_path / "hf", ["llava"])["llava"]
    convert.hf_to_dcp(path, tmp_path / "llava.ckpt")
    wrapper = nn.Module()
    wrapper.model = tiny_hf_model("llava", seed=1)
    store.load(tmp_path / "llava.ckpt", wrapper, [], strict=True, rank=0, world_size=1, fitting=False)
    import transformers

    reference = transformers.LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    for key, value in reference.state_dict().items():
        assert torch.equal(wrapper.model.state_dict()[key], value), key


def test_checkpoint_records_come_from_registered_providers():
    from lightning_mm.checkpoint import collect_records, register_record_provider
    from lightning_mm.checkpoint import record_providers as records

    assert records._providers["hf"] is hf_records  # registered by importing lightning_mm.hf
    wrapper = nn.Module()
    wrapper.model = _tiny_llama()
    assert collect_records(wrapper)["hf"] == hf_records(wrapper)
    register_record_provider("hf", hf_records)  # the same provider again: nothing changes
    with pytest.raises(ValueError, match="already registered under 'hf'"):
        register_record_provider("hf", lambda root: [])
    with pytest.raises(ValueError, match="checkpoint's own keys"):
        register_record_provider("world_size", lambda root: 1)
