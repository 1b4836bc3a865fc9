"""Checkpoints through real Lightning jobs on CPU (gloo): see tests/scenarios/ckpt_scenarios.py.

One module-scoped pipeline (4 launches, two of them on 2 ranks) produces everything these tests assert on:
1 rank (a checkpoint to reshard, strict/non-strict), 2 ranks killed mid-save, 2 ranks (exact resume, ModelCheckpoint
features, resharding, torch format, a tiny Llama), conversions in this process, then 1 rank again (2 -> 1, and
training from converted files).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_mm.checkpoint import open_source
from lightning_mm.commands import convert_command as convert_cmd
from tests.helpers.scenario_kit import run
from tests.scenarios import ckpt_scenarios


def _json(work: Path, name: str, rank: int = 0) -> dict:
    return json.loads((work / f"{name}.rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaForCausalLM

    work = tmp_path_factory.mktemp("ckpt")
    run(ckpt_scenarios.one_rank, work, timeout=600)
    crash = run(ckpt_scenarios.crash, work, expect_ok=False, timeout=600)
    assert crash.returncode != 0, "the crash scenario should have been killed"
    # What the crash left, before anything else touches the directory.
    (work / "crash_state.json").write_text(
        json.dumps(
            {
                "entries": sorted(p.name for p in (work / "crash").iterdir()),
                "last_step": open_source(work / "crash" / "last.ckpt").meta["global_step"],
                "partials": [
                    sorted(q.name for q in p.iterdir())
                    for p in (work / "crash").iterdir()
                    if p.name.startswith(".last.ckpt.partial-")
                ],
            }
        )
    )
    run(ckpt_scenarios.main, work, timeout=600)

    # Conversions, in this (single) process, through the CLI entry point.
    assert convert_cmd.main(["dcp-to-torch", str(work / "all" / "step=6.ckpt"), str(work / "step6.pt")]) == 0
    assert convert_cmd.main(["dcp-to-hf", str(work / "llama.ckpt"), str(work / "hf_out")]) == 0
    assert convert_cmd.main(["hf-to-dcp", str(work / "hf_out"), str(work / "llama_back.ckpt")]) == 0
    from tests.scenarios.ckpt_scenarios import tiny_llama_config

    torch.manual_seed(11)
    hf_model = LlamaForCausalLM(tiny_llama_config())
    hf_model.save_pretrained(work / "hf_saved")  # Hugging Face's own writer (omits the tied lm_head)
    torch.save(hf_model.state_dict(), work / "hf_saved_ref.pt")
    assert convert_cmd.main(["hf-to-dcp", str(work / "hf_saved"), str(work / "hf_saved.ckpt")]) == 0

    run(ckpt_scenarios.one_rank_after, work, timeout=600)
    return work


def _states_equal(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert len(a["optimizers"]) == len(b["optimizers"])
    for oa, ob in zip(a["optimizers"], b["optimizers"]):
        assert oa["state"].keys() == ob["state"].keys()
        for fqn in oa["state"]:
            for name, value in oa["state"][fqn].items():
                assert torch.equal(value, ob["state"][fqn][name]), (fqn, name)
        assert oa["param_groups"] == ob["param_groups"]


def _load(work: Path, name: str) -> dict:
    return torch.load(work / name, weights_only=True)


# ------------------------------------------------------------------------------------------ resume
def test_exact_resume_mid_epoch_and_at_epoch_boundary_is_bit_identical(work):
    for rank in (0, 1):
        main = _json(work, "main", rank)
        full = main["uninterrupted"]
        assert len(full) == 12 and len(set(full)) == 12
        assert main["resumed_3"] == {"start": 3, "losses": full[3:]}  # mid-epoch: dataloader position restored
        assert main["resumed_6"] == {"start": 6, "losses": full[6:]}  # epoch boundary
    assert _json(work, "main", 0)["uninterrupted"] != _json(work, "main", 1)["uninterrupted"]


def test_torch_format_trains_identically_and_resumes_exactly(work):
    for rank in (0, 1):
        main = _json(work, "main", rank)
        assert main["torch_losses"] == main["uninterrupted"]
        assert main["torch_resumed_3"] == {"start": 3, "losses": main["uninterrupted"][3:]}
        assert main["torch_listing"] == {f"step={s}.ckpt": {"link": None, "complete": True} for s in (3, 6, 9, 12)}
    assert (work / "torch" / "step=3.ckpt").is_file()


def test_model_checkpoint_top_k_last_link_and_every_n_steps(work):
    main = _json(work, "main")
    # save_top_k=2 on a monitored metric: exactly the two best remain; the rest were removed (directories).
    best = main["best_listing"]
    assert sorted(k for k in best if k != "last.ckpt") == main["best_k"] and len(main["best_k"]) == 2
    assert all(v["complete"] for v in best.values())
    # save_last="link": a symlink to the last checkpoint saved, which is complete.
    assert best["last.ckpt"]["link"] == main["best_last_saved"]
    # every_n_train_steps=3 with save_last=True (a copy, overwritten atomically each time).
    assert main["all_listing"] == {f"step={s}.ckpt": {"link": None, "complete": True} for s in (3, 6, 9, 12)} | {
        "last.ckpt": {"link": None, "complete": True}
    }
    assert open_source(work / "all" / "last.ckpt").meta["global_step"] == 12


def test_kill_mid_save_keeps_previous_checkpoint_and_last_resumes_from_it(work):
    crash = json.loads((work / "crash_state.json").read_text())
    # Rank 1 was killed while step 4's last.ckpt was being written: the half-written one is hidden and incomplete,
    # last.ckpt is still step 2's, and the earlier checkpoints are complete.
    assert crash["last_step"] == 2
    assert [name for name in crash["entries"] if not name.startswith(".")] == [
        "last.ckpt",
        "step=2.ckpt",
        "step=4.ckpt",
    ]
    assert len(crash["partials"]) == 1 and ".metadata" not in crash["partials"][0]
    assert "meta.pt" not in crash["partials"][0]
    for rank in (0, 1):
        main = _json(work, "main", rank)
        assert main["resumed_last_after_crash"] == {"start": 2, "losses": main["uninterrupted"][2:]}
    # The next save of last.ckpt cleared the leftover.
    assert not any(name.startswith(".") for name in _json(work, "main")["crash_listing_after"])


# -------------------------------------------------------------------------------------- resharding
def test_reshard_fsdp_hsdp_and_world_sizes_gives_identical_full_state(work):
    ref6 = _load(work, "ref6.pt")
    _states_equal(_load(work, "loaded_fsdp.pt"), ref6)  # 2 -> 2
    _states_equal(_load(work, "loaded_hsdp.pt"), ref6)  # FSDP (2) -> HSDP (2x1)
    _states_equal(_load(work, "loaded_two_to_one.pt"), ref6)  # 2 -> 1
    _states_equal(_load(work, "loaded_from_hsdp.pt"), _load(work, "ref_hsdp.pt"))  # HSDP -> FSDP
    _states_equal(_load(work, "loaded_from_one.pt"), _load(work, "ref_one.pt"))  # 1 -> 2
    assert _json(work, "main")["hsdp_mesh"] == [2, 1]
    # Per-rank state cannot follow a new world size: a warning, not an error.
    assert "saved on 1 rank(s) and is loaded on 2" in _json(work, "main")["one_to_two_warnings"][0]
    assert "saved on 2 rank(s) and is loaded on 1" in _json(work, "one_rank_after")["two_to_one_warnings"][0]


# ------------------------------------------------------------------------------------- strictness
def test_strict_load_lists_keys_and_non_strict_reports_what_it_skipped(work):
    one = _json(work, "one_rank")
    error = one["strict_error"]
    assert error.startswith("CheckpointKeyError")
    for key in ("model.out.weight", "model.out.bias", "model.head.weight", "model.head.bias"):
        assert key in error
    model_warning, optim_warning = one["nonstrict_warnings"]
    assert "missing from the checkpoint: model.out.weight, model.out.bias" in model_warning
    assert "unexpected in the checkpoint: model.head.weight, model.head.bias" in model_warning
    assert "optimizer 0" in optim_warning
    # The matching keys were loaded (weights and optimiser state); the renamed head kept its fresh state.
    ref, loaded = _load(work, "ref_one.pt"), _load(work, "nonstrict.pt")
    assert one["nonstrict_start_step"] == 3
    for key in ("model.layers.0.weight", "model.layers.1.bias"):
        assert torch.equal(loaded["model"][key], ref["model"][key])
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded["optimizers"][0]["state"][key][name], ref["optimizers"][0]["state"][key][name])
    assert "model.out.weight" in loaded["model"] and "model.out.weight" not in ref["model"]


# -------------------------------------------------------------------------------------- conversion
def test_dcp_to_torch_equals_the_training_state_and_resumes(work):
    full = torch.load(work / "step6.pt", weights_only=True, mmap=True)
    ref = _load(work, "ref6.pt")
    _states_equal({"model": full["state_dict"], "optimizers": full["optimizer_states"]}, ref)
    assert full["global_step"] == 6 and full["lightning_mm"]["format"] == "torch"
    _states_equal(_load(work, "loaded_from_torch_file.pt"), ref)  # the consolidated file resumes (on 1 rank)


def test_dcp_to_hf_to_dcp_round_trips_and_trains_from_hf_weights(work):
    from transformers import LlamaForCausalLM

    ref = _load(work, "ref_llama.pt")["model"]
    hf = LlamaForCausalLM.from_pretrained(work / "hf_out").state_dict()
    assert json.loads((work / "hf_out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert {f"model.{k}" for k in hf} == set(ref)
    for key, value in ref.items():
        assert torch.equal(hf[key[len("model.") :]], value), key
    back = open_source(work / "llama_back.ckpt")
    tensors = back.read_full(list(back.shapes))
    # The tied lm_head is stored once in the HF files (as save_pretrained does): an alias of the embedding here.
    assert {k.split("/", 1)[1] for k in tensors} == set(ref) - {"model.lm_head.weight"}
    for key, value in tensors.items():
        assert torch.equal(value, ref[key.split("/", 1)[1]]), key
    # fit(ckpt_path=<hf-to-dcp output>) starts from the HF weights with a fresh loop; also from HF's own writer
    # (tied lm_head omitted from the files).
    after = _json(work, "one_rank_after")
    loaded = _load(work, "loaded_llama_back.ckpt.pt")["model"]
    assert after["llama_back.ckpt"]["start"] == 0 and len(after["llama_back.ckpt"]["losses"]) == 1
    for key, value in ref.items():
        assert torch.equal(loaded[key], value), key
    saved_ref = torch.load(work / "hf_saved_ref.pt", weights_only=True)
    loaded = _load(work, "loaded_hf_saved.ckpt.pt")["model"]
    assert "model.lm_head.weight" not in open_source(work / "hf_saved.ckpt").meta["state_dict"]  # tied: an alias
    for key, value in saved_ref.items():
        assert torch.equal(loaded[f"model.{key}"], value), key


def test_dcp_to_torch_works_on_every_kind_of_checkpoint_this_project_writes(work, tmp_path):
    """HSDP, 1-rank, weights-only (from HF), torch-format and save_last copies all consolidate."""
    cases = {
        "hsdp.ckpt": "ref_hsdp.pt",
        "one.ckpt": "ref_one.pt",
        "llama_back.ckpt": None,
        "torch/step=3.ckpt": None,
        "all/last.ckpt": None,
        "best/last.ckpt": None,
    }
    for name, ref in cases.items():
        out = tmp_path / (name.replace("/", "_") + ".pt")
        assert convert_cmd.main(["dcp-to-torch", str(work / name), str(out)]) == 0, name
        full = torch.load(out, weights_only=True)
        assert full["state_dict"] and all(isinstance(v, torch.Tensor) for v in full["state_dict"].values()), name
        if ref is not None:
            _states_equal({"model": full["state_dict"], "optimizers": full["optimizer_states"]}, _load(work, ref))
