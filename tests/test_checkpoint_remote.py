"""Checkpoints at fsspec URLs: an S3 API server on localhost (moto, started once for this module) and ``memory://``.

The 2-rank jobs are in tests/scenarios/ckpt_remote_scenarios.py (one killed mid-save, one that saves with
ModelCheckpoint, resumes from URLs and resumes after the crash); the fault cases run here, in this process, on what they
wrote and on ``memory://`` checkpoints of a plain module.
"""

from __future__ import annotations

import json
import socket
import warnings
from pathlib import Path

import fsspec
import pytest
import torch
from torch import nn

from lightning_mm.checkpoint import CheckpointIntegrityError, remote, store
from lightning_mm.checkpoint.checkpoint_errors import CheckpointNotFoundError
from tests.helpers.scenario_kit import run
from tests.scenarios import ckpt_remote_scenarios

SECRET = "sEcReT-lightning-mm-remote-7f3a9c"  # must never reach an object or a log
BUCKET = "ckpts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3() -> dict:
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {
        "key": "AKIALIGHTNINGMMTEST",
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "eu-west-1"},
    }
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.mkdir(BUCKET, region_name="eu-west-1")
    yield {"endpoint": endpoint, "storage_options": options, "bucket": f"s3://{BUCKET}", "fs": fs}
    server.stop()


@pytest.fixture(scope="module")
def work(s3, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("remote")
    (work / "s3.json").write_text(json.dumps({k: s3[k] for k in ("endpoint", "storage_options", "bucket")}))
    crash = run(ckpt_remote_scenarios.crash, work, expect_ok=False)
    assert crash.returncode != 0, "the crash scenario should have been killed"
    fs = s3["fs"]
    fs.invalidate_cache()
    after_crash = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/crash", detail=False))
    staged = [p for p in fs.ls(f"{BUCKET}/crash", detail=False) if ".partial-" in p]
    staged_url = f"s3://{staged[0]}" if staged else None
    staged_error = None
    last_step = remote.open_source(f"s3://{BUCKET}/crash/last.ckpt", s3["storage_options"]).meta["global_step"]
    if staged_url:
        with pytest.raises(CheckpointIntegrityError) as caught:
            remote.open_source(staged_url, s3["storage_options"])
        staged_error = str(caught.value)
    main = run(ckpt_remote_scenarios.main, work)
    fs.invalidate_cache()
    return {
        "dir": work,
        "after_crash": after_crash,
        "last_step": last_step,
        "staged_error": staged_error,
        "staged_url": staged_url,
        "logs": crash.stdout + crash.stderr + main.stdout + main.stderr,
        "main": [json.loads((work / f"main.rank{r}.json").read_text()) for r in range(2)],
    }


def _names(fs, prefix: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(prefix, detail=False, refresh=True))


def test_modelcheckpoint_writes_and_removes_checkpoints_at_an_s3_url(s3, work):
    fs = s3["fs"]
    assert _names(fs, f"{BUCKET}/run") == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    assert _names(fs, f"{BUCKET}/top") == ["step=4.ckpt"]  # save_top_k=1 removed the earlier one
    files = _names(fs, f"{BUCKET}/run/step=4.ckpt")
    assert files == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "meta.pt"])
    manifest = json.loads(fs.cat_file(f"{BUCKET}/run/step=4.ckpt/manifest.json"))
    assert sorted(manifest["files"]) == sorted(f for f in files if f != "manifest.json")


def test_resuming_from_an_s3_url_continues_exactly(work):
    main = work["main"][0]
    assert main["resumed_2"]["start"] == 2
    assert main["resumed_2"]["losses"] == pytest.approx(main["uninterrupted"][2:], rel=1e-6)
    ref = torch.load(work["dir"] / "ref.pt", weights_only=True)
    resumed = torch.load(work["dir"] / "resumed.pt", weights_only=True)
    for key, value in ref["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=1e-6, atol=0)
    for saved, back in zip(ref["optimizers"], resumed["optimizers"]):
        for name, entries in saved["state"].items():
            for k, v in entries.items():
                torch.testing.assert_close(back["state"][name][k], v, rtol=1e-6, atol=0)


def test_a_save_killed_midway_leaves_last_resumable_and_its_staging_is_cleaned_up(s3, work):
    assert work["last_step"] == 2  # the save killed midway was step 4's overwrite of last.ckpt
    assert work["staged_url"] is not None, work["after_crash"]  # the interrupted save's staging prefix
    assert "manifest.json: missing" in work["staged_error"] and "not a complete checkpoint" in work["staged_error"]
    resumed = work["main"][0]["resumed_last_after_crash"]
    assert resumed["start"] == 2 and len(resumed["losses"]) == 2
    left = _names(s3["fs"], f"{BUCKET}/crash")
    assert not [n for n in left if ".partial-" in n or ".removing-" in n], left
    assert left == ["last.ckpt", "step=2.ckpt", "step=4-v1.ckpt", "step=4.ckpt"]  # Lightning versions the name


def test_credentials_reach_no_object_and_no_log(s3, work):
    fs = s3["fs"]
    objects = fs.find(BUCKET)
    assert len(objects) > 20
    for path in objects:
        assert SECRET.encode() not in fs.cat_file(path), path
    assert SECRET not in work["logs"]


def test_a_foreign_or_missing_object_on_s3_is_a_clear_error(s3, work):
    fs, options = s3["fs"], s3["storage_options"]
    fs.copy(f"{BUCKET}/run/step=2.ckpt", f"{BUCKET}/faults/foreign.ckpt", recursive=True)
    fs.pipe_file(f"{BUCKET}/faults/foreign.ckpt/__7_0.distcp", b"from another run")
    with pytest.raises(CheckpointIntegrityError, match=r"foreign.ckpt/__7_0.distcp: not part of this checkpoint"):
        remote.open_source(f"s3://{BUCKET}/faults/foreign.ckpt", options)
    fs.copy(f"{BUCKET}/run/step=2.ckpt", f"{BUCKET}/faults/missing.ckpt", recursive=True)
    fs.rm_file(f"{BUCKET}/faults/missing.ckpt/__1_0.distcp")
    with pytest.raises(CheckpointIntegrityError, match=r"missing.ckpt/__1_0.distcp: missing"):
        remote.open_source(f"s3://{BUCKET}/faults/missing.ckpt", options)
    with pytest.raises(CheckpointNotFoundError, match="checkpoint not found: s3://ckpts/faults/none.ckpt"):
        remote.open_source(f"s3://{BUCKET}/faults/none.ckpt", options)


# ---------------------------------------------------------------------------------------------- memory://
def _trained() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()
    checkpoint = {
        "state_dict": store.model_state(model, full=False),
        "optimizer_states": [store.optimizer_state(model, optimizer, full=False)],
        "global_step": 1,
    }
    return model, optimizer, checkpoint


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _load(url: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> store.Loaded:
    return store.load(
        url, model, [optimizer], strict=True, rank=0, world_size=1, fitting=True, source=remote.open_source(url)
    )


def test_memory_url_round_trip_replace_and_remove():
    model, optimizer, checkpoint = _trained()
    url = "memory://mm-run/step=1.ckpt"
    remote.save(checkpoint, url, "torch_dcp", {"kind": "training"}, None)
    remote.save(checkpoint, url, "torch_dcp", {"kind": "training"}, None)  # replaces it
    fs = fsspec.filesystem("memory")
    assert _names(fs, "/mm-run") == ["step=1.ckpt"]
    fresh, fresh_optimizer = _fresh()
    assert _load(url, fresh, fresh_optimizer).checkpoint["global_step"] == 1
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    saved, loaded = optimizer.state_dict()["state"][0], fresh_optimizer.state_dict()["state"][0]
    assert torch.equal(saved["exp_avg"], loaded["exp_avg"])
    remote.remove(url)
    assert _names(fs, "/mm-run") == []


def test_memory_url_faults_name_the_object():
    _, _, checkpoint = _trained()
    fs = fsspec.filesystem("memory")
    url = "memory://mm-faults/a.ckpt"
    remote.save(checkpoint, url, "torch_dcp", {"kind": "training"}, None)
    fs.rm_file("/mm-faults/a.ckpt/manifest.json")  # as a save interrupted before its commit leaves it
    with pytest.raises(CheckpointIntegrityError, match=r"a.ckpt/manifest.json: missing, so .* not a complete"):
        _load(url, *_fresh())
    remote.save(checkpoint, url, "torch_dcp", {"kind": "training"}, None)
    data = bytearray(fs.cat_file("/mm-faults/a.ckpt/__0_0.distcp"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file("/mm-faults/a.ckpt/__0_0.distcp", bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"a.ckpt/__0_0.distcp: its content differs"):
        _load(url, *_fresh())
    remote.save(checkpoint, url, "torch_dcp", {"kind": "training"}, None)
    fs.pipe_file("/mm-faults/a.ckpt/meta.pt", b"not a torch file")
    with pytest.raises(CheckpointIntegrityError, match=r"a.ckpt/meta.pt: truncated|a.ckpt/meta.pt: its content"):
        _load(url, *_fresh())


def test_an_abandoned_staging_prefix_is_removed_by_the_next_save_and_live_ones_are_kept():
    _, _, checkpoint = _trained()
    fs = fsspec.filesystem("memory")
    gone = "/mm-partials/.a.ckpt.partial-00000000-999999999-1-deadbeef"  # another host: kept
    fs.pipe_file(f"{gone}/__0_0.distcp", b"x")
    ours = str(remote.RemoteStore("memory://mm-partials/b.ckpt").staging())  # named after this process: removed
    fs.pipe_file(f"{ours}/__0_0.distcp", b"x")
    remote.save(checkpoint, "memory://mm-partials/a.ckpt", "torch_dcp", {"kind": "training"}, None)
    assert _names(fs, "/mm-partials") == [".a.ckpt.partial-00000000-999999999-1-deadbeef", "a.ckpt"]


def test_url_detection():
    assert remote.is_url("s3://bucket/run") and remote.is_url("memory://x") and remote.is_url("gs://b/c")
    assert not remote.is_url("/tmp/x") and not remote.is_url("file:///tmp/x") and not remote.is_url(Path("s3:/x"))


def test_convert_reads_and_writes_urls(tmp_path):
    from lightning_mm.commands import convert_command as convert_cmd

    model, _, checkpoint = _trained()
    remote.save(checkpoint, "memory://mm-convert/a.ckpt", "torch_dcp", {"kind": "training"}, None)
    assert convert_cmd.main(["dcp-to-torch", "memory://mm-convert/a.ckpt", "memory://mm-convert/a.pt"]) == 0
    fs = fsspec.filesystem("memory")
    assert _names(fs, "/mm-convert") == ["a.ckpt", "a.pt"]
    fs.get_file("/mm-convert/a.pt", str(tmp_path / "a.pt"))
    full = torch.load(tmp_path / "a.pt", weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(full["state_dict"][name], value)
    assert convert_cmd.main(["dcp-to-torch", "memory://mm-convert/a.ckpt", "memory://mm-convert/a.pt"]) == 1  # exists
    options = tmp_path / "options.json"
    options.write_text("{}")
    assert (
        convert_cmd.main(
            ["dcp-to-torch", "memory://mm-convert/a.ckpt", str(tmp_path / "b.pt"), "--storage-options", str(options)]
        )
        == 0
    )
    assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=True)["state_dict"]["0.weight"], model[0].weight)
    fs.rm_file("/mm-convert/a.ckpt/manifest.json")
    assert convert_cmd.main(["dcp-to-torch", "memory://mm-convert/a.ckpt", str(tmp_path / "c.pt")]) == 1
    assert not (tmp_path / "c.pt").exists()


def test_torch_format_to_a_url_is_refused_before_anything_is_written():
    _, _, checkpoint = _trained()
    with pytest.raises(ValueError, match="checkpoint_format='torch' cannot be written to a URL"):
        remote.save(checkpoint, "memory://mm-torch/a.ckpt", "torch", {}, None)
    assert not fsspec.filesystem("memory").exists("/mm-torch")


def test_ckpt_path_last_with_a_modelcheckpoint_at_a_url_names_the_url_to_pass():
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mm.strategies.launch import check_ckpt_path

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath="memory://mm-last/run")],
    )

    def fit_impl(model: object = None, ckpt_path: object = None) -> None: ...

    with pytest.raises(ValueError, match=r'pass the URL itself, ckpt_path="memory://mm-last/run/last.ckpt"'):
        check_ckpt_path(fit_impl, (), {"ckpt_path": "last"}, trainer)


def _one_mib_checkpoint() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024))  # a 1 MiB weight: a shard far larger than a sample's blocks
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {
        "state_dict": store.model_state(model, full=False),
        "optimizer_states": [store.optimizer_state(model, optimizer, full=False)],
        "global_step": 1,
    }


def _flip_outside_the_sample(fs, path: str) -> None:
    from lightning_mm.checkpoint.remote import _BLOCK_SIZE, _sample_offsets

    data = bytearray(fs.cat_file(path))
    sampled = [range(o, o + _BLOCK_SIZE) for o in _sample_offsets(len(data))]
    offset = next(i for i in range(len(data) // 3, len(data)) if not any(i in r for r in sampled))
    data[offset] ^= 0x01
    fs.pipe_file(path, bytes(data))


def test_a_remote_checkpoint_carries_a_version_2_manifest_and_any_changed_byte_fails_the_load(tmp_path):
    """Issue #38 (7): every object's whole digest is recorded and checked on every load (also full_check=False),
    so that a converter reading it gives no "checked by sample only" warning."""
    from lightning_mm.checkpoint import digest
    from lightning_mm.commands import convert_command as convert_cmd

    url, path = "memory://mm-every-byte/a.ckpt", "/mm-every-byte/a.ckpt/__0_0.distcp"
    remote.save(_one_mib_checkpoint(), url, "torch_dcp", {"kind": "training"}, None)
    fs = fsspec.filesystem("memory")
    written = json.loads(fs.cat_file("/mm-every-byte/a.ckpt/manifest.json"))
    assert written["version"] == 2 and written["hash"] == digest.NAME
    local = tmp_path / "a.ckpt"
    local.mkdir()
    for name in written["files"]:
        fs.get_file(f"/mm-every-byte/a.ckpt/{name}", str(local / name))
        assert written["files"][name] == {
            "size": (local / name).stat().st_size,
            "xxh3_128": digest.file_digest(local / name),
        }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "checked by sample only"
        assert convert_cmd.main(["dcp-to-torch", url, str(tmp_path / "a.pt")]) == 0
    _flip_outside_the_sample(fs, path)
    for full_check in (True, False):
        with pytest.raises(CheckpointIntegrityError, match=r"a.ckpt/__0_0.distcp: its content differs"):
            remote.open_source(url, full_check=full_check)


def test_a_remote_version_1_manifest_still_loads_and_is_checked_by_its_sha256():
    """Checkpoints written at URLs by earlier versions (SHA-256 and a sample fingerprint per object)."""
    url, root = "memory://mm-version-1/a.ckpt", "/mm-version-1/a.ckpt"
    remote.save(_one_mib_checkpoint(), url, "torch_dcp", {"kind": "training"}, None)
    fs, where = fsspec.filesystem("memory"), remote.RemoteStore(url)
    files = json.loads(fs.cat_file(f"{root}/manifest.json"))["files"]
    old = {
        name: {
            "size": e["size"],
            "sha256": where.sha256(f"{root}/{name}"),
            "sample": where.sample(f"{root}/{name}", e["size"]),
        }
        for name, e in files.items()
    }
    body = {
        "manifest": "lightning-mm checkpoint",
        "version": 1,
        "id": "0",
        "hash": "sha256 of 16 MiB chunks",
        "files": old,
    }
    fs.pipe_file(f"{root}/manifest.json", json.dumps(body).encode())
    assert remote.open_source(url).meta["global_step"] == 1
    _flip_outside_the_sample(fs, f"{root}/__0_0.distcp")
    with pytest.raises(CheckpointIntegrityError, match=r"a.ckpt/__0_0.distcp: its content differs"):
        remote.open_source(url)
    remote.open_source(url, full_check=False)  # what a version 1 manifest offers without its SHA-256: a sample


def test_a_remote_manifest_is_bounded_before_it_is_read():
    """Issue #38 (2), at a URL: refused from its listed size; too many entries refused before any is checked."""
    from lightning_mm.checkpoint import manifest

    url, root = "memory://mm-bounded/a.ckpt", "/mm-bounded/a.ckpt"
    remote.save(_one_mib_checkpoint(), url, "torch_dcp", {"kind": "training"}, None)
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{root}/manifest.json", b" " * (manifest.MAX_BYTES + 1))
    with pytest.raises(
        CheckpointIntegrityError, match=rf"a.ckpt/manifest.json: {manifest.MAX_BYTES + 1} bytes, more than"
    ):
        remote.open_source(url)
    body = json.loads(
        json.dumps(
            manifest.manifest_body({f"x{i}": {"size": 0, "xxh3_128": ""} for i in range(manifest.MAX_FILES + 1)})
        )
    )
    fs.pipe_file(f"{root}/manifest.json", json.dumps(body).encode())
    with pytest.raises(CheckpointIntegrityError, match=rf"a.ckpt/manifest.json: lists {manifest.MAX_FILES + 1} files"):
        remote.open_source(url)


def test_save_last_link_at_an_s3_dirpath_is_one_line_from_the_cli(s3, tmp_path):
    """docs/checkpoints.md: ``save_last="link"`` needs a local directory. ``lightning-mm fit`` says so in one line
    naming the key, before Lightning's ``ModelCheckpoint.setup`` would raise it with a traceback."""
    import os
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parents[1]
    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 2,
            "logger": False,
            "default_root_dir": str(tmp_path),  # where LightningCLI writes config.yaml
            "enable_progress_bar": False,
            "strategy": {"class_path": "lightning_mm.MMFSDP2Strategy"},
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": f"{s3['bucket']}/link", "save_last": "link", "every_n_train_steps": 1},
                }
            ],
        },
        "model": {
            "class_path": "lightning_mm.MMLightningModule",
            "init_args": {
                "model_provider": "examples.migration.pretrain_custom.model_provider",
                "forward_step": "examples.migration.pretrain_custom.forward_step",
            },
        },
        "data": {
            "class_path": "lightning_mm.MMDataModule",
            "init_args": {
                "train_valid_test_datasets_provider": "examples.migration.pretrain_custom."
                "train_valid_test_datasets_provider"
            },
        },
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    options = s3["storage_options"]
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "OMP_NUM_THREADS": "1",
        "FSSPEC_S3_KEY": options["key"],
        "FSSPEC_S3_SECRET": options["secret"],
        "FSSPEC_S3_ENDPOINT_URL": s3["endpoint"],
    }
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_mm.cli", "fit", "--config", str(tmp_path / "cfg.yaml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [
        f"lightning-mm fit: error: ModelCheckpoint(dirpath='{s3['bucket']}/link'): save_last='link' needs a local "
        "directory (an object store has no symbolic links); use save_last: true"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not s3["fs"].exists(f"{BUCKET}/link")
