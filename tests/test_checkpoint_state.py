"""Optimiser state across checkpoint layouts, strategies and world sizes; Hugging Face export; inference mode.

Two launches of tests/scenarios/ckptstate_scenarios.py (a tiny LLaVA whose vision tower's last layer gets no gradient):
2 ranks (plain Lightning DDP and mm_fsdp2, uninterrupted and resumed), then 1 rank (2 -> 1). Plain Lightning DDP
and plain torch are the references. The Hugging Face export is compared with ``save_pretrained`` in this process.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import Strategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from lightning_mm import MMFSDP2Strategy
from lightning_mm.checkpoint import CheckpointKeyError, open_source, store
from lightning_mm.hf.checkpoint_records import hf_records
from lightning_mm.hf.dcp_conversion import dcp_to_hf
from tests.helpers.scenario_kit import run
from tests.scenarios import ckptstate_scenarios
from tests.scenarios.hf_scenarios import FamilyData, model_inputs, tiny_hf_model
from tests.test_checkpoint import EXTRA, Net, _trained

RESUMED = slice(3, 6)  # the steps after the checkpoint at step 3


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("ckptstate")
    run(ckptstate_scenarios.pre, work, timeout=900)  # 1 rank: the checkpoints resumed on 2 ranks (1 -> 2)
    run(ckptstate_scenarios.two, work, timeout=900)
    run(ckptstate_scenarios.one, work, timeout=900)
    return work


def _json(work: Path, name: str) -> dict:
    return json.loads((work / f"{name}.rank0.json").read_text())


def _json_rank(work: Path, name: str, rank: int) -> dict:
    return json.loads((work / f"{name}.rank{rank}.json").read_text())


def _load(work: Path, name: str) -> dict:
    return torch.load(work / name, weights_only=True)


def _states_equal(a: dict, b: dict) -> None:
    """Model and (name-keyed) optimiser state bit-identical, including which parameters have optimiser state."""
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for oa, ob in zip(a["optimizers"], b["optimizers"], strict=True):
        assert oa["state"].keys() == ob["state"].keys()
        for fqn in oa["state"]:
            assert oa["state"][fqn].keys() == ob["state"][fqn].keys(), fqn
            for name, value in oa["state"][fqn].items():
                assert torch.equal(value, ob["state"][fqn][name]), (fqn, name)
        assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]


def _stateless(state: dict) -> list[str]:
    optim = state["optimizers"][0]
    return [p for g in optim["param_groups"] for p in g["params"] if p not in optim["state"]]


def _close(actual: list[float], expected: list[float], rel: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a == pytest.approx(e, rel=rel)


# ------------------------------------------------------------------------------------ no gradients
def test_parameters_without_gradients_resume_strictly_and_exactly(work):
    """LLaVA's unused last vision layer has no AdamW state: the strict resume agrees, on 2 ranks and 2 -> 1."""
    at3 = _load(work, "mm.at3.pt")
    unused = _stateless(at3)
    assert "model.model.vision_tower.encoder.layers.1.mlp.fc1.weight" in unused and len(unused) == 18
    two = _json(work, "two")
    for name in ("from_mm", "from_mm_torch"):  # sharded and consolidated checkpoints, strict (the default)
        assert two[name] == two["mm"][RESUMED], name
        _states_equal(_load(work, f"{name}.start.pt"), at3)  # still no state for the unused parameters
        _states_equal(_load(work, f"{name}.end.pt"), _load(work, "mm.end.pt"))
    _states_equal(_load(work, "mm_to_one.start.pt"), at3)  # resharded 2 -> 1


# ------------------------------------------------------------------------------ other strategies
def test_lightning_ddp_checkpoint_resumes_model_and_optimizer_exactly_on_any_world_size(work):
    """A plain Lightning DDP checkpoint (optimiser state keyed by index) resumes under mm_fsdp2 as under DDP."""
    ddp = torch.load(work / "ddp.ckpt", weights_only=True)
    assert all(isinstance(k, int) for k in ddp["optimizer_states"][0]["state"])  # torch's layout, no names
    assert "param_names" not in ddp["optimizer_states"][0]["param_groups"][0]
    at3 = _load(work, "ddp.at3.pt")
    assert len(_stateless(at3)) == 18  # DDP leaves the unused parameters without state too
    _states_equal(_load(work, "from_ddp.start.pt"), at3)  # 2 ranks
    _states_equal(_load(work, "ddp_to_one.start.pt"), at3)  # 1 rank
    one = _json(work, "one")  # a single-device Lightning checkpoint, the same layout
    _states_equal(_load(work, "from_single.start.pt"), _load(work, "single.at3.pt"))
    _close(one["from_single"], one["single"][RESUMED])
    single_end, from_single_end = _load(work, "single.end.pt"), _load(work, "from_single.end.pt")
    for key, value in single_end["model"].items():
        torch.testing.assert_close(from_single_end["model"][key], value, rtol=1e-5, atol=0, msg=key)
    two = _json(work, "two")
    _close(two["from_ddp"], two["ddp"][RESUMED])  # per step, against the uninterrupted DDP run
    ref, resumed = _load(work, "ddp.end.pt"), _load(work, "from_ddp.end.pt")
    for key, value in ref["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=1e-5, atol=0, msg=key)


# -------------------------------------------------------------------------------------- torch layout
def test_torch_format_writes_torch_layout_that_plain_torch_loads(work):
    """checkpoint_format="torch": index-keyed state with the names alongside; plain torch loads it."""
    ckpt = torch.load(work / "mm.pt", weights_only=True)
    optim_state = ckpt["optimizer_states"][0]
    group = optim_state["param_groups"][0]
    at3 = _load(work, "mm.at3.pt")
    names = at3["optimizers"][0]["param_groups"][0]["params"]
    assert group["params"] == list(range(len(names))) and "param_names" not in group  # as torch writes it
    assert ckpt["lightning_mm"]["optimizer_param_names"] == [[names]]  # what the indices stand for, beside it
    assert all(isinstance(k, int) for k in optim_state["state"])

    model = tiny_hf_model("llava", seed=3).train()
    model.load_state_dict({k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer.load_state_dict(optim_state)
    by_name = dict(zip(names, model.parameters(), strict=True))
    expected = at3["optimizers"][0]["state"]
    assert {n for n, p in by_name.items() if p in optimizer.state} == set(expected)
    for name, entries in expected.items():
        for key, value in entries.items():
            assert torch.equal(optimizer.state[by_name[name]][key], value), (name, key)
    # Plain torch goes on as the 2-rank run did: its global batches (each rank's batch, losses averaged as
    # DDP/FSDP average gradients) give the same losses, step by step.
    batches = [_load(work, f"mm.batches.rank{rank}.pt") for rank in range(2)]
    losses = []
    for step in range(3):
        loss = sum(model(**model_inputs(batches[rank][step])).loss for rank in range(2)) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    per_rank = [_json_rank(work, "two", rank)["mm"][RESUMED] for rank in range(2)]
    _close(losses, [(a + b) / 2 for a, b in zip(*per_rank)])


# ------------------------------------------------------------------------------------- inference
def test_checkpoint_entry_points_work_inside_inference_mode(work):
    """lightning_module_state_dict, optimizer_state, save_checkpoint (Trainer's and a keyword call), load."""
    end = _load(work, "mm.end.pt")
    assert _json(work, "two")["inference_load_step"] == 6
    for name in ("inference.ckpt", "keyword.ckpt"):
        source = open_source(work / name)
        tensors = source.read_full(list(source.shapes))
        for key, value in end["model"].items():
            assert torch.equal(tensors[f"state_dict/{key}"], value), (name, key)
        for fqn, entries in end["optimizers"][0]["state"].items():
            for entry, value in entries.items():
                assert torch.equal(tensors[f"optimizer_states/0/state/{fqn}/{entry}"], value), (name, fqn, entry)
    full = torch.load(work / "inference.pt", weights_only=True)
    for key, value in end["model"].items():
        assert torch.equal(full["state_dict"][key], value), key


def test_trainer_test_from_a_checkpoint_inside_inference_mode(work):
    """Lightning's own tests run ``trainer.test(ckpt_path=...)`` inside ``torch.inference_mode()``: the model is
    built, sharded and evaluated there and gives the loss it gives outside it."""
    out = _json(work, "two")
    assert math.isfinite(out["test_loss"])
    assert out["test_loss_inference_mode"] == out["test_loss"]


# ----------------------------------------------------------------------------------- signatures
@pytest.mark.parametrize(
    "method",
    [
        "lightning_module_state_dict",
        "load_model_state_dict",
        "optimizer_state",
        "load_optimizer_state_dict",
        "save_checkpoint",
        "load_checkpoint",
        "remove_checkpoint",
        "process_dataloader",
        "on_train_batch_start",
    ],
)
def test_checkpoint_methods_keep_lightnings_signature(method):
    ours, theirs = getattr(MMFSDP2Strategy, method), getattr(Strategy, method)
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)
    assert getattr(ours, "__override__", False), f"{method} is not marked @override"


# --------------------------------------------------------------------------------------- HF export
def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _compare_with_save_pretrained(model: torch.nn.Module, converted: Path, reference: Path) -> None:
    model.save_pretrained(reference)
    assert sorted(os.listdir(converted)) == sorted(os.listdir(reference))
    ours, theirs = _safetensors(converted / "model.safetensors"), _safetensors(reference / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    for name in ("config.json", "generation_config.json"):
        assert json.loads((converted / name).read_text()) == json.loads((reference / name).read_text()), name
    for file in converted.iterdir():  # not owner-only: readable as any new file here
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~_umask(), file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "llama_tied"])
def test_dcp_to_hf_writes_what_save_pretrained_writes(family, tmp_path):
    """Saved-layout key names (not in-memory ones), tied weights once, generation_config.json, same logits."""
    model = tiny_hf_model(family, seed=5)
    root = torch.nn.Module()
    root.model = model  # as in an MMLightningModule: the checkpoint's keys are `model.<in-memory name>`
    state = {f"model.{k}": v for k, v in model.state_dict().items()}  # tied weights under both names
    torch.save({"state_dict": state, "lightning_mm": {"hf": hf_records(root)}}, tmp_path / "ckpt.pt")
    converted = dcp_to_hf(tmp_path / "ckpt.pt", tmp_path / "converted")
    _compare_with_save_pretrained(model, converted, tmp_path / "reference")
    files = _safetensors(converted / "model.safetensors")
    if family == "qwen2_5_vl":
        assert any(k.startswith("visual.") for k in files) and not any(k.startswith("model.visual.") for k in files)
    if family == "llama_tied":
        assert "lm_head.weight" not in files and "model.embed_tokens.weight" in files

    loaded = type(model).from_pretrained(converted).eval()
    batch = torch.utils.data.default_collate([FamilyData(family)[i] for i in range(2)])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(**model_inputs(batch)).logits, model.eval()(**model_inputs(batch)).logits, rtol=0, atol=0
        )


def test_dcp_to_hf_converts_tensors_as_save_pretrained_does(tmp_path):
    """Qwen3-MoE keeps its experts fused in memory and saves them one tensor per expert: the converted directory
    holds save_pretrained's files and loads back to the same logits."""
    from tests.helpers.moe_models import tiny_moe_model

    model = tiny_moe_model("qwen3_moe", seed=5)
    root = torch.nn.Module()
    root.model = model
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "lightning_mm": {"hf": hf_records(root)}}, tmp_path / "ckpt.pt")
    converted = dcp_to_hf(tmp_path / "ckpt.pt", tmp_path / "converted")
    _compare_with_save_pretrained(model, converted, tmp_path / "reference")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in _safetensors(converted / "model.safetensors")
    loaded = type(model).from_pretrained(converted).eval()
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_dcp_to_hf_of_a_sharded_training_checkpoint_matches_save_pretrained(work, tmp_path):
    """The 2-rank LLaVA checkpoint (torch_dcp): the same files as save_pretrained of its weights."""
    converted = dcp_to_hf(work / "mm.ckpt", tmp_path / "converted")
    model = tiny_hf_model("llava", seed=3)
    model.load_state_dict({k.removeprefix("model."): v for k, v in _load(work, "mm.at3.pt")["model"].items()})
    _compare_with_save_pretrained(model, converted, tmp_path / "reference")


# --------------------------------------------------------------------------------- in one process
def _optimizer_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    assert len(a.state) == len(b.state)
    for pa, pb in zip(
        [p for g in a.param_groups for p in g["params"]], [p for g in b.param_groups for p in g["params"]], strict=True
    ):
        assert (pa in a.state) == (pb in b.state)
        for key, value in a.state.get(pa, {}).items():
            assert torch.equal(b.state[pb][key], value), key


def _lightning_file(path: Path, net: torch.nn.Module, optim_state: dict) -> None:
    torch.save({"epoch": 0, "global_step": 2, "state_dict": net.state_dict(), "optimizer_states": [optim_state]}, path)


def test_index_keyed_state_maps_by_position_and_refuses_other_group_sizes(tmp_path):
    """torch's layout (what DDP/single-device Lightning writes), including a parameter without state."""
    net, opt = _trained()
    net.spare = torch.nn.Linear(2, 2)  # never used: no gradient, no optimiser state
    opt.add_param_group({"params": list(net.spare.parameters()), "lr": 0.5})
    _lightning_file(tmp_path / "ddp.ckpt", net, opt.state_dict())

    torch.manual_seed(9)
    fresh = Net()
    fresh.spare = torch.nn.Linear(2, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_opt.param_groups[0]["params"] = [p for n, p in fresh.named_parameters() if not n.startswith("spare")]
    fresh_opt.add_param_group({"params": list(fresh.spare.parameters()), "lr": 0.01})
    store.load(tmp_path / "ddp.ckpt", fresh, [fresh_opt], strict=True, rank=0, world_size=1, fitting=True)
    _optimizer_states_equal(opt, fresh_opt)
    assert fresh_opt.param_groups[1]["lr"] == 0.5  # the saved hyper-parameters
    for key, value in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key

    one_group = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with pytest.raises(CheckpointKeyError, match=r"sizes \[4, 2\].*sizes \[6\]"):
        store.load(tmp_path / "ddp.ckpt", fresh, [one_group], strict=True, rank=0, world_size=1, fitting=True)


def test_old_name_keyed_torch_files_still_load(tmp_path):
    """checkpoint_format="torch" files written before the index-keyed layout (names as keys) resume as before."""
    net, opt = _trained()
    by_name = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert isinstance(next(iter(by_name["state"])), str)
    store.save(
        {"epoch": 0, "global_step": 2, "state_dict": net.state_dict(), "optimizer_states": [by_name]},
        tmp_path / "old.ckpt",
        "torch",
        EXTRA,
        None,
    )
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    store.load(tmp_path / "old.ckpt", fresh, [fresh_opt], strict=True, rank=0, world_size=1, fitting=True)
    _optimizer_states_equal(opt, fresh_opt)


def test_full_optimizer_state_is_what_plain_torch_loads():
    """The gathered state (checkpoint_format="torch") is torch's own ``state_dict()``, key for key; plain
    ``Optimizer.load_state_dict`` takes it."""
    net, opt = _trained()
    full = store.optimizer_state(net, opt, full=True)
    assert_same_state(full, opt.state_dict())
    assert "param_names" not in full["param_groups"][0]
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_opt.load_state_dict(full)
    _optimizer_states_equal(opt, fresh_opt)


# ------------------------------------------------------------------ the restored state is the saved one
def assert_same_state(a, b, where="state") -> None:
    """Equal key for key (dicts), item for item (lists), tensors bit-identical: Lightning's round-trip check."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (
            f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        )
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def _named_trained(seed: int = 0):
    """As _trained, with the optimizer built over named parameters (torch then keeps `param_names`), named
    otherwise than their module paths."""
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW([(f"mine.{n}", p) for n, p in net.named_parameters()], lr=0.1)
    for _ in range(2):
        net(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("fresh_named", [False, True])
def test_another_strategys_checkpoint_restores_its_state_key_for_key(tmp_path, named, fresh_named):
    """A DDP/single-device checkpoint (``optimizer.state_dict()``): the restored ``optimizer_state`` (torch layout)
    is that dict, with ``param_names`` exactly where the saved one had them (an optimizer over named parameters)."""
    net, opt = _named_trained() if named else _trained()
    saved = opt.state_dict()
    assert ("param_names" in saved["param_groups"][0]) is named
    _lightning_file(tmp_path / "ddp.ckpt", net, saved)
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.named_parameters() if fresh_named else fresh.parameters(), lr=0.5)
    store.load(tmp_path / "ddp.ckpt", fresh, [fresh_opt], strict=True, rank=0, world_size=1, fitting=True)
    restored = store.optimizer_state(fresh, fresh_opt, full=True)
    if named or not fresh_named:
        assert_same_state(restored, saved)
    else:  # names the saved state lacks: the optimizer keeps its own, as torch's load_state_dict does
        assert restored["param_groups"][0].pop("param_names") == [n for n, _ in fresh.named_parameters()]
        assert_same_state(restored, saved)
    _optimizer_states_equal(opt, fresh_opt)


@pytest.mark.parametrize("fmt", ["torch", "torch_dcp"])
@pytest.mark.parametrize("named", [False, True])
def test_own_checkpoints_restore_the_saved_state_key_for_key(tmp_path, fmt, named):
    """Saved by this project in either format: the restored ``optimizer_state`` equals the one saved."""
    from lightning_mm.checkpoint import OPTIMIZER_NAMES_KEY, optimizer_param_names

    net, opt = _named_trained() if named else _trained()
    before = store.optimizer_state(net, opt, full=fmt == "torch")
    extra = {**EXTRA, OPTIMIZER_NAMES_KEY: optimizer_param_names(net, [opt])} if fmt == "torch" else EXTRA
    store.save(
        {"epoch": 0, "global_step": 2, "state_dict": net.state_dict(), "optimizer_states": [before]},
        tmp_path / "c.ckpt",
        fmt,
        extra,
        None,
    )
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.named_parameters() if named else fresh.parameters(), lr=0.5)
    store.load(tmp_path / "c.ckpt", fresh, [fresh_opt], strict=True, rank=0, world_size=1, fitting=True)
    assert_same_state(store.optimizer_state(fresh, fresh_opt, full=fmt == "torch"), before)
    _optimizer_states_equal(opt, fresh_opt)


def test_torch_files_from_before_the_names_record_still_map_by_their_names(tmp_path):
    """Such files kept this project's names in ``param_names``: used to map the indices, then dropped."""
    net, opt = _trained()
    state = store.optimizer_state(net, opt, full=True)
    names = [n for n, _ in net.named_parameters()]
    swap = [1, 0, 2, 3]  # index 0 holds the second parameter's state: position would mismatch, the names decide
    old = {**state, "param_groups": [{**state["param_groups"][0], "param_names": [names[i] for i in swap]}]}
    old["state"] = {i: state["state"][swap[i]] for i in range(4)}
    store.save(
        {"epoch": 0, "global_step": 2, "state_dict": net.state_dict(), "optimizer_states": [old]},
        tmp_path / "old.ckpt",
        "torch",
        EXTRA,
        None,
    )
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    store.load(tmp_path / "old.ckpt", fresh, [fresh_opt], strict=True, rank=0, world_size=1, fitting=True)
    _optimizer_states_equal(opt, fresh_opt)
    assert "param_names" not in fresh_opt.state_dict()["param_groups"][0]


def _optstate(work: Path, name: str, when: str, view: str, rank: int = 0) -> list:
    return torch.load(work / f"{name}.optstate.{when}.{view}.rank{rank}.pt", weights_only=True)


@pytest.mark.parametrize(
    ("resumed", "source", "ranks"),
    [
        ("from_mm", "mm", 2),  # torch_dcp, same world size
        ("from_mm_torch", "mm", 2),  # torch, same world size
        ("mm_to_one", "mm", 1),  # 2 -> 1
        ("mm_to_one_torch", "mm", 1),
        ("one_to_two", "mm1", 2),  # 1 -> 2
        ("one_to_two_torch", "mm1", 2),
    ],
)
def test_restored_optimizer_state_is_the_saved_one_key_for_key(work, resumed, source, ranks):
    """Lightning's round trip: ``strategy.optimizer_state`` after the restore equals it before the save, key for
    key (param_groups entries included): gathered (torch layout) always, and each rank's shards (name-keyed) when
    the world size is the same."""
    assert_same_state(_optstate(work, resumed, "restored", "torch"), _optstate(work, source, "saved", "torch"))
    source_ranks = 1 if source == "mm1" else 2
    if ranks == source_ranks:
        for rank in range(ranks):
            assert_same_state(
                _optstate(work, resumed, "restored", "torch_dcp", rank),
                _optstate(work, source, "saved", "torch_dcp", rank),
            )


@pytest.mark.parametrize(("resumed", "source"), [("from_ddp", "ddp"), ("ddp_to_one", "ddp"), ("from_single", "single")])
def test_another_strategys_optimizer_state_is_restored_key_for_key(work, resumed, source):
    """A DDP or single-device checkpoint under mm_fsdp2: the gathered ``optimizer_state`` is the saving strategy's
    ``optimizer_state``, key for key, and no group gains a ``param_names`` (in either layout)."""
    saved = _optstate(work, source, "saved", "own")
    assert "param_names" not in saved[0]["param_groups"][0]
    assert_same_state(_optstate(work, resumed, "restored", "torch"), saved)
    sharded = _optstate(work, resumed, "restored", "torch_dcp")
    for now, then in zip(sharded[0]["param_groups"], saved[0]["param_groups"], strict=True):
        assert now.keys() == then.keys()  # the same entries; params are names in this layout
        assert {k: v for k, v in now.items() if k != "params"} == {k: v for k, v in then.items() if k != "params"}


# ---------------------------------------------------------------- Lightning's own round-trip tests, adapted
@pytest.fixture(scope="module")
def round_trips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("roundtrip")
    run(ckptstate_scenarios.lightning_round_trips, work, timeout=600)
    return work


@pytest.mark.parametrize("name", ["boring_all", "boring_half", "boring_root", "template"])
def test_lightnings_load_optimizer_states_and_standard_checkpoint_tests_pass(round_trips, name):
    """Lightning's ``test_strategy_load_optimizer_states`` (test_fsdp.py, the three wrappings) and
    ``test_load_standard_checkpoint_into_distributed_model`` (the template model), with MMFSDP2Strategy in its
    defaults (the fused optimizer step on): the restored model and optimizer state is the DDP run's, exactly
    (``fused`` stays unset in the groups, although the step is fused)."""
    rank0 = torch.load(round_trips / f"{name}.roundtrip.rank0.pt", weights_only=True)
    rank1 = torch.load(round_trips / f"{name}.roundtrip.rank1.pt", weights_only=True)
    assert len(rank1["restored"]["model"]) == 0 and len(rank1["restored"]["optimizer"]) == 0  # full state: rank 0
    saved, restored = rank0["saved"], rank0["restored"]
    assert len(saved["model"]) == len(restored["model"])
    assert len(saved["optimizer"]) == len(restored["optimizer"])
    torch.testing.assert_close(saved["model"], restored["model"], atol=0, rtol=0)
    torch.testing.assert_close(saved["optimizer"], restored["optimizer"], atol=0, rtol=0)
    assert saved["optimizer"]["param_groups"] == restored["optimizer"]["param_groups"]  # key for key, incl. None
    assert restored["fused_groups"] == [0]  # the fused step is chosen for the group ...
    assert all(g["fused"] is None for g in restored["groups_now"])  # ... and not written into it
