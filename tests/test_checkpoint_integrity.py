"""Checkpoint integrity (issue #12): foreign, missing, truncated or altered files; references outside the
checkpoint; full disks and corrupted files as clear errors; leftover partials.

One 2-rank run (tests/scenarios/integrity_scenarios.py, ~10 s) writes two checkpoints of the same FSDP2 model (runs
``a`` and ``b``) and, on a small tmpfs when one can be mounted, meets a full disk. The tests attack copies of those
checkpoints in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mm.checkpoint import atomic, manifest, store
from lightning_mm.checkpoint.checkpoint_errors import CheckpointError, CheckpointIntegrityError, CheckpointWriteError
from lightning_mm.commands import convert_command as convert_cmd
from lightning_mm.hf import dcp_conversion as convert
from tests.helpers.scenario_kit import run
from tests.scenarios import integrity_scenarios

ROOT = Path(__file__).resolve().parents[1]
EXTRA = {"format_version": 1, "kind": "training", "world_size": 1, "rng_point": "next_batch", "hf": []}


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[bool]:
    """Mount a tmpfs of ``size`` at ``path`` for the block; False where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
        if shutil.which("mount")
        else False
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, bool]]:
    work = tmp_path_factory.mktemp("integrity")
    with _tmpfs(work / "full_disk", "1m") as mounted:
        args = {"full_disk": work / "full_disk"} if mounted else {}
        run(integrity_scenarios.save, work, args=args, launcher="torchrun")
        yield work, mounted


def _copy(runs: tuple[Path, bool], name: str, tmp_path: Path, as_name: str = "c.ckpt") -> Path:
    return Path(shutil.copytree(runs[0] / f"{name}.ckpt", tmp_path / as_name))


def _forge_manifest(directory: Path) -> None:
    """What an attacker who controls every file does: a manifest matching the files as they now are."""
    manifest.write_manifest(directory, [], [p.name for p in directory.iterdir() if p.name != manifest.MANIFEST_FILE])


def _dcp_to_torch_fails(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture, match: str) -> None:
    out = tmp_path / "out.pt"
    assert convert_cmd.main(["dcp-to-torch", str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert match in err, err
    assert not out.exists() and atomic.stale_partials(out) == []


# ------------------------------------------------------------------------ 2: every file bound to its checkpoint
def test_foreign_missing_truncated_or_altered_files_fail_naming_the_file(runs, tmp_path, capsys):
    genuine = store.open_source(runs[0] / "a.ckpt", full_check=True)
    listed = json.loads((runs[0] / "a.ckpt" / manifest.MANIFEST_FILE).read_text())["files"]
    assert sorted(listed) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]  # hashed by both ranks
    assert any(k.startswith("optimizer_states") for k in genuine.shapes)

    mixed = _copy(runs, "a", tmp_path, "mixed.ckpt")  # a shard of run b copied into run a (same model, same size)
    shutil.copyfile(runs[0] / "b.ckpt" / "__1_0.distcp", mixed / "__1_0.distcp")
    with pytest.raises(CheckpointIntegrityError, match=r"mixed\.ckpt/__1_0\.distcp: .*another checkpoint"):
        store.open_source(mixed)
    _dcp_to_torch_fails(mixed, tmp_path, capsys, "__1_0.distcp")

    missing = _copy(runs, "a", tmp_path, "missing.ckpt")
    (missing / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"missing\.ckpt/__0_0\.distcp: missing"):
        store.open_source(missing)

    truncated = _copy(runs, "a", tmp_path, "truncated.ckpt")
    with open(truncated / "__0_0.distcp", "r+b") as f:
        f.truncate(f.seek(0, 2) - 10)
    with pytest.raises(CheckpointIntegrityError, match=r"truncated\.ckpt/__0_0\.distcp: truncated"):
        store.open_source(truncated)

    extra = _copy(runs, "a", tmp_path, "extra.ckpt")
    shutil.copyfile(runs[0] / "b.ckpt" / "__1_0.distcp", extra / "__2_0.distcp")
    with pytest.raises(CheckpointIntegrityError, match=r"__2_0\.distcp: not part of this checkpoint"):
        store.open_source(extra)

    altered = _copy(runs, "a", tmp_path, "altered.ckpt")  # one byte between the sampled blocks
    size = (altered / "__1_0.distcp").stat().st_size
    with open(altered / "__1_0.distcp", "r+b") as f:
        f.seek(size // 6)
        byte = f.read(1)
        f.seek(size // 6)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointIntegrityError, match=r"altered\.ckpt/__1_0\.distcp: .*altered"):
        store.open_source(altered)  # every load checks every byte (issue #27)
    _dcp_to_torch_fails(altered, tmp_path, capsys, "__1_0.distcp")

    stripped = _copy(runs, "a", tmp_path, "stripped.ckpt")  # written with a manifest: removing it does not help
    (stripped / manifest.MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"manifest\.json: missing"):
        store.open_source(stripped)


def test_a_checkpoint_from_before_manifests_loads_with_a_warning(runs, tmp_path):
    old = _copy(runs, "a", tmp_path, "old.ckpt")
    (old / manifest.MANIFEST_FILE).unlink()
    meta = torch.load(old / "meta.pt", weights_only=True)
    del meta["lightning_mm"]["manifest"]
    torch.save(meta, old / "meta.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = store.open_source(old)
    assert any("has no manifest.json" in str(w.message) for w in caught)
    assert source.read_full(list(source.shapes))  # reads all of it


# ------------------------------------------------------------------------ 3: nothing read outside the checkpoint
def _point_shards_at(directory: Path, target: str) -> None:
    """Rewrite ``.metadata`` so that every read of ``__1_0.distcp`` goes to ``target`` (and forge the manifest)."""
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own genuine file
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=target) if info.relative_path == "__1_0.distcp" else info
        for index, info in metadata.storage_data.items()
    }
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _forge_manifest(directory)


def test_shard_references_outside_the_checkpoint_are_refused(runs, tmp_path, capsys):
    other = runs[0] / "b.ckpt" / "__1_0.distcp"
    for name in ("absolute", "dotdot"):
        crafted = _copy(runs, "a", tmp_path, f"{name}.ckpt")
        _point_shards_at(crafted, str(other) if name == "absolute" else os.path.relpath(other, crafted))
        with pytest.raises(CheckpointIntegrityError, match="not a file of the checkpoint directory"):
            store.open_source(crafted)
        _dcp_to_torch_fails(crafted, tmp_path, capsys, "not a file of the checkpoint directory")

    linked = _copy(runs, "a", tmp_path, "linked.ckpt")
    (linked / "__1_0.distcp").unlink()
    (linked / "__1_0.distcp").symlink_to(other)
    _forge_manifest(linked)
    with pytest.raises(CheckpointIntegrityError, match=r"__1_0\.distcp: is a symbolic link"):
        store.open_source(linked)

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": str(other)}}))
    with pytest.raises(CheckpointIntegrityError, match="not a file of the checkpoint directory"):
        convert.hf_to_dcp(hf, tmp_path / "from_hf.ckpt")


# ------------------------------------------------------------------------ 9: clear errors
def test_a_full_disk_fails_every_rank_with_no_space_left_and_keeps_earlier_checkpoints(runs):
    work, mounted = runs
    if not mounted:
        pytest.skip("mounting a tmpfs is not permitted here (the one-process test injects ENOSPC instead)")
    for rank in range(2):
        record = json.loads((work / f"full_disk.rank{rank}.json").read_text())
        assert record["raised"] == "CheckpointWriteError" and record["errno"] == errno.ENOSPC
        assert record["message"] == f"{work / 'full_disk' / 'train.ckpt'}: No space left on device"
        assert record["listing"] == ["weights.ckpt"]  # the partial was removed; the earlier checkpoint is whole
    source = store.open_source(work / "full_disk" / "weights.ckpt", full_check=True)
    assert source.read_full(list(source.shapes))


def test_full_disk_truncated_and_corrupted_files_in_one_process_say_so(runs, tmp_path, capsys, monkeypatch):
    net = nn.Linear(256, 256)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 256)).sum().backward()
    opt.step()
    small = {"epoch": 0, "global_step": 1, "state_dict": net.state_dict()}
    big = small | {"optimizer_states": [opt.state_dict()]}
    disk = tmp_path / "disk"
    with _tmpfs(disk, "512k") as mounted:
        if not mounted:  # no tmpfs here: the same failure injected where torch.save meets the disk
            real_save = torch.save

            def full_disk_save(obj, f, *args, **kwargs):
                if isinstance(obj, dict) and "optimizer_states" in obj:
                    raise RuntimeError(
                        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
                    ) from OSError(errno.ENOSPC, "No space left on device")
                return real_save(obj, f, *args, **kwargs)

            monkeypatch.setattr(torch, "save", full_disk_save)
        store.save(small, disk / "small.pt", "torch", EXTRA, None)
        with pytest.raises(CheckpointWriteError) as info:
            store.save(big, disk / "big.pt", "torch", EXTRA, None)
        assert info.value.errno == errno.ENOSPC and str(info.value) == f"{disk / 'big.pt'}: No space left on device"
        assert sorted(p.name for p in disk.iterdir()) == ["small.pt"]
        assert store.open_source(disk / "small.pt").meta["global_step"] == 1
        assert convert_cmd.main(["dcp-to-torch", str(runs[0] / "a.ckpt"), str(disk / "a.pt")]) == 1
        assert f"{disk / 'a.pt'}: No space left on device" in capsys.readouterr().err
        monkeypatch.undo()

    # A truncated torch file, a corrupted meta.pt: the file and the state are named, and no unsafe advice.
    store.save(big, tmp_path / "t.pt", "torch", EXTRA, None)
    with open(tmp_path / "t.pt", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(CheckpointIntegrityError, match=r"t\.pt: truncated") as info:
        store.open_source(tmp_path / "t.pt")
    assert not isinstance(info.value, EOFError)
    bad = _copy(runs, "a", tmp_path, "bad.ckpt")
    payload = bytearray((bad / "meta.pt").read_bytes())
    payload[len(payload) // 2 : len(payload) // 2 + 64] = b"\x00" * 64
    (bad / "meta.pt").write_bytes(bytes(payload))
    _forge_manifest(bad)
    with pytest.raises(CheckpointError, match=r"bad\.ckpt/meta\.pt: (corrupted|truncated)") as info:
        store.open_source(bad)
    assert "weights_only=False" not in str(info.value) and "`weights_only` set to `False`" not in str(info.value)
    # A truncated Hugging Face shard given to hf-to-dcp.
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(1000)}, str(hf / "model.safetensors"))
    with open(hf / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(CheckpointIntegrityError, match=r"hf/model\.safetensors: not a readable safetensors file"):
        convert.hf_to_dcp(hf, tmp_path / "from_hf.ckpt")
    # Without a manifest (an old checkpoint), a truncated shard is still found before DCP reads it.
    old = _copy(runs, "a", tmp_path, "old.ckpt")
    (old / manifest.MANIFEST_FILE).unlink()
    with open(old / "__1_0.distcp", "r+b") as f:
        f.truncate(f.seek(0, 2) - 10)
    with pytest.raises(CheckpointIntegrityError, match=r"old\.ckpt/__1_0\.distcp: truncated"):
        store.open_source(old)


# ------------------------------------------------------------------------ 11: leftovers
def test_leftover_partials_of_this_run_and_of_dead_processes_go_at_the_next_save(tmp_path):
    def token(pid: int) -> str:
        return f"{atomic._host()}-{pid}-{atomic._start_time(pid) or 0}-0123abcd"

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = atomic.partial_path(tmp_path / "step=1.ckpt")  # a failed earlier save of this run, another name
        dead = atomic.partial_path(tmp_path / "step=2.ckpt", token(int(gone.stdout)))
        running = atomic.partial_path(tmp_path / "step=3.ckpt", token(alive.pid))  # another job, still writing
        elsewhere = tmp_path / ".step=4.ckpt.partial-00000000-1-1-0123abcd"  # another host: cannot tell
        unknown = tmp_path / ".step=5.ckpt.partial-0123456789ab"  # not this version's naming
        stranger = tmp_path / ".cache"
        for path in (mine, dead, running, elsewhere, unknown, stranger):
            path.mkdir()
            (path / "__0_0.distcp").write_bytes(b"x")
        net = nn.Linear(2, 2)
        store.save(
            {"epoch": 0, "global_step": 0, "state_dict": net.state_dict()},
            tmp_path / "last.ckpt",
            "torch_dcp",
            EXTRA,
            None,
        )
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([running.name, elsewhere.name, unknown.name, stranger.name, "last.ckpt"])
    finally:
        alive.kill()
        alive.wait()
