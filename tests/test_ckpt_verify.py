"""Every byte checked on load, and saves in the background (issue #27, items 1 and 2).

Two 2-rank launches of tests/scenarios/ckpt_verify_scenarios.py (``crash``, then ``main``) produce what the distributed
tests assert on; the rest runs in this process.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mm import MMFSDP2Strategy
from lightning_mm.checkpoint import digest, manifest, store, zip_manifest
from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError
from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import ckpt_verify_scenarios

EXTRA = {"format_version": 1, "kind": "training", "world_size": 1, "rng_point": "next_batch", "hf": []}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("ckpt_verify")
    crash = run(ckpt_verify_scenarios.crash, work, expect_ok=False)
    assert crash.returncode != 0, "rank 1 should have been killed"
    run(ckpt_verify_scenarios.main, work)
    return work


# ------------------------------------------------------------------------------- 1: every byte checked
def test_a_weight_damaged_outside_the_sampled_blocks_fails_fit_on_every_rank_before_any_step(work):
    main = read_results(work, "main")
    damage = main[0]["dcp_damage"]
    assert damage["fqn"].startswith("state_dict") and damage["file"] == "__1_0.distcp"
    assert not any(start <= damage["position"] < end for start, end in damage["blocks"])  # a sample misses it
    sizes = {
        name: entry["size"]
        for name, entry in json.loads((work / "dcp_bad.ckpt" / manifest.MANIFEST_FILE).read_text())["files"].items()
    }
    assert "__1_0.distcp" not in digest.assign(sizes, 0, 2, prefer=manifest.shard_rank)  # rank 1 hashes it
    for rank in (0, 1):  # rank 0 learns it from rank 1: no rank goes on alone
        assert main[rank]["dcp_bad"] == {
            "raised": "CheckpointIntegrityError",
            "steps": 0,
            "message": f"{work / 'dcp_bad.ckpt' / '__1_0.distcp'}: its content differs from the checkpoint's "
            "manifest: the file was altered or comes from another checkpoint",
        }
        assert main[rank]["dcp_resumed"] == {"start": 2, "steps": 2}  # the undamaged original resumes


def test_one_float_of_a_torch_file_set_to_nan_fails_fit_on_every_rank_before_any_step(work):
    main = read_results(work, "main")
    record = main[0]["torch_damage"]["record"]
    for rank in (0, 1):
        assert main[rank]["torch_bad"] == {
            "raised": "CheckpointIntegrityError",
            "steps": 0,
            "message": f"{work / 'torch_bad.ckpt'}: record {record} differs from its manifest: the file was altered "
            "or damaged",
        }
        assert main[rank]["torch_resumed"] == {"start": 2, "steps": 2}
    # The file is still an ordinary torch file.
    assert torch.load(work / "torch.ckpt", weights_only=True)["global_step"] == 2


def _linear_checkpoint(path: Path, fmt: str = "torch_dcp", size: int = 256) -> None:
    torch.manual_seed(0)
    net = nn.Linear(size, size)
    store.save({"epoch": 0, "global_step": 1, "state_dict": net.state_dict()}, path, fmt, EXTRA, None)


def _flip(path: Path, position: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x01]))


def _as_version_1(directory: Path) -> None:
    """Rewrite the manifest as lightning-mm wrote it before full checks on load (SHA-256 and a sample)."""
    files = {}
    for name in json.loads((directory / manifest.MANIFEST_FILE).read_text())["files"]:
        path = directory / name
        size = path.stat().st_size
        files[name] = {"size": size, "sha256": manifest._sha256(path), "sample": manifest._sample(path, size)}
    (directory / manifest.MANIFEST_FILE).write_text(
        json.dumps(
            {
                "manifest": "lightning-mm checkpoint",
                "version": 1,
                "id": "0",
                "hash": "sha256 of 16 MiB chunks",
                "sample": {"blocks": 4, "block_size": 65536},
                "files": files,
            }
        )
    )


def test_a_version_1_manifest_loads_with_a_warning_that_it_is_checked_by_sample_only(tmp_path):
    old = tmp_path / "old.ckpt"
    _linear_checkpoint(old)
    _as_version_1(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = store.open_source(old)
    assert [str(w.message) for w in caught if "checked by sample only" in str(w.message)] == [
        f"{old}: its manifest.json is of an older lightning-mm (version 1), which recorded sampled fingerprints for "
        "loads: its files are checked by sample only (256 KiB of each; `lightning-mm convert dcp-to-torch` checks "
        "their SHA-256). Save it again to have every byte checked on load"
    ]
    assert torch.equal(source.read_full(["state_dict/weight"])["state_dict/weight"], _fresh_weight())
    shard = next(old.glob("*.distcp"))
    size = shard.stat().st_size
    blocks = manifest._sample_offsets(size, 4, 64 * 1024)
    _flip(shard, next(p for p in range(0, size, 4096) if not any(b <= p < b + 64 * 1024 for b in blocks)))
    store.open_source(old)  # what a version 1 manifest promises: a sample
    with pytest.raises(CheckpointIntegrityError, match=r"old\.ckpt/__0_0\.distcp: its content differs"):
        store.open_source(old, full_check=True)  # the converters check its SHA-256


def _fresh_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return nn.Linear(256, 256).weight.detach()


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_any_byte_of_a_shard_changed_fails_the_load_naming_the_file(tmp_path, where):
    path = tmp_path / "c.ckpt"
    _linear_checkpoint(path)
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    _flip(shard, {"start": 0, "middle": size // 3 + 7, "end": size - 1}[where])
    with pytest.raises(CheckpointIntegrityError, match=r"c\.ckpt/__0_0\.distcp: its content differs"):
        store.open_source(path)


def test_a_torch_file_carries_its_manifest_and_any_changed_record_fails_naming_it(tmp_path):
    path = tmp_path / "t.ckpt"
    _linear_checkpoint(path, "torch")
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["weight"], _fresh_weight())
    found = zip_manifest.records(path)
    assert sum(name.endswith(zip_manifest.RECORD) for name in found) == 1
    body = zip_manifest.verify(path)
    assert body is not None and set(body["records"]) == {n for n in found if not n.endswith(zip_manifest.RECORD)}
    for name in ("data.pkl", "data/0"):
        damaged = tmp_path / f"damaged-{name.replace('/', '_')}.ckpt"
        shutil.copyfile(path, damaged)
        record = next(n for n in found if n.endswith("/" + name))
        offset, size, _ = found[record]
        _flip(damaged, offset + size // 2)
        with pytest.raises(
            CheckpointIntegrityError,
            match=rf"{damaged.name}: record {record} differs from its "
            "manifest",
        ):
            store.open_source(damaged)
    extended = tmp_path / "extended.ckpt"  # a record added afterwards is not the file that was written
    shutil.copyfile(path, extended)
    with zipfile.ZipFile(extended, "a") as z:
        z.writestr(f"{record.split('/')[0]}/data/99", b"\0" * 64)
    with pytest.raises(CheckpointIntegrityError, match=r"record .*/data/99 is not in the file's manifest"):
        store.open_source(extended)


@pytest.mark.parametrize("manifest_record", [True, False])
def test_a_torch_file_with_bytes_appended_inserted_or_prepended_fails_naming_the_file(tmp_path, manifest_record):
    """Issue #38 (7): every record is whole and checked, but the file is longer than was written; torch.load itself
    reads an appended file as if nothing had happened."""
    path = tmp_path / "t.ckpt"
    if manifest_record:
        _linear_checkpoint(path, "torch", size=16)
    else:  # another Lightning strategy's file
        torch.save({"epoch": 0, "global_step": 1, "state_dict": {"model.w": torch.arange(64.0)}}, path)
    data = path.read_bytes()
    store.open_source(path)
    first_record_end = min(o + s for o, s, _ in zip_manifest.records(path).values())
    for name, altered in {
        "appended-1": data + b"\0",
        "appended-4096": data + b"\0" * 4096,
        "appended-1M": data + b"\0" * (1 << 20),
        "prepended": b"\0" * 64 + data,
        "inserted": data[:first_record_end] + b"\0" * 64 + data[first_record_end:],
    }.items():
        damaged = tmp_path / f"{name}.ckpt"
        damaged.write_bytes(altered)
        if name.startswith("appended-1") and name != "appended-1M":
            assert torch.load(damaged, weights_only=True)["global_step"] == 1  # what the check is for
        with pytest.raises(CheckpointIntegrityError, match=rf"{name}\.ckpt: .*(appended|inserted)"):
            store.open_source(damaged)


def test_a_torch_file_is_bounded_before_its_archive_and_its_manifest_record_are_read(tmp_path):
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(4)}}, plain)
    data = bytearray(plain.read_bytes())
    end64 = data.rfind(b"PK\x06\x06")  # torch.save writes zip64 end records: entries at bytes 32-40
    data[end64 + 32 : end64 + 40] = (10**9).to_bytes(8, "little")
    plain.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"plain\.ckpt: 1000000000 records .* more than a torch file"):
        store.open_source(plain)
    path = tmp_path / "t.ckpt"
    torch.save({"state_dict": {"w": torch.ones(4)}}, path)
    archive = next(iter(zip_manifest.records(path))).split("/")[0]
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(f"{archive}/{zip_manifest.RECORD}", b" " * (48 << 20 + 1))
    with pytest.raises(
        CheckpointIntegrityError, match=r"t\.ckpt: its manifest record .* more than a manifest may have"
    ):
        store.open_source(path)


def test_a_torch_file_without_manifest_is_checked_against_the_crc32s_torch_save_records(tmp_path):
    plain = tmp_path / "plain.ckpt"  # e.g. another Lightning strategy's checkpoint
    torch.save({"epoch": 0, "global_step": 1, "state_dict": {"model.w": torch.arange(4096.0)}}, plain)
    assert zip_manifest.verify(plain) is None
    store.open_source(plain)
    offset, size, _ = next(v for k, v in zip_manifest.records(plain).items() if k.endswith("/data/0"))
    with open(plain, "r+b") as f:
        f.seek(offset + size // 2 // 4 * 4)
        f.write(struct.pack("<f", float("nan")))
    with pytest.raises(
        CheckpointIntegrityError,
        match=r"plain\.ckpt: record plain/data/0 differs from the CRC-32 "
        "torch.save recorded",
    ):
        store.open_source(plain)


def _v2_body(files: dict) -> dict:
    return {"manifest": "lightning-mm checkpoint", "version": 2, "id": "0", "hash": digest.NAME, "files": files}


def test_a_manifest_above_its_documented_size_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """Issue #38 (2): a manifest of 200 MB took 95 s and 5 GB before a MemoryError; now its size alone refuses it."""
    path = tmp_path / "c.ckpt"
    _linear_checkpoint(path)
    with open(path / manifest.MANIFEST_FILE, "r+b") as f:
        f.truncate(200 << 20)  # sparse: 200 MB of zeros after the real manifest
    parsed = []
    monkeypatch.setattr(manifest.json, "loads", lambda data: parsed.append(len(data)))
    with pytest.raises(
        CheckpointIntegrityError,
        match=rf"c\.ckpt/manifest\.json: {200 << 20} bytes, more than a manifest may have \(33554432 bytes: "
        r"at most 65536 files of at most 512 bytes each\); refused without reading",
    ):
        store.open_source(path)
    assert parsed == []


@pytest.mark.parametrize("body", ["deep", "long_int"])
def test_a_manifest_nested_too_deep_or_with_a_huge_number_is_a_clear_error(tmp_path, body):
    path = tmp_path / "c.ckpt"
    _linear_checkpoint(path)
    text = "[" * 200_000 + "]" * 200_000 if body == "deep" else '{"size": ' + "9" * 100_000 + "}"
    (path / manifest.MANIFEST_FILE).write_text(text)
    with pytest.raises(CheckpointIntegrityError, match=r"c\.ckpt/manifest\.json: not a valid manifest"):
        store.open_source(path)


def test_a_manifest_listing_more_files_than_a_checkpoint_may_have_is_refused_before_any_is_checked(
    tmp_path, monkeypatch
):
    path = tmp_path / "c.ckpt"
    _linear_checkpoint(path)
    files = {f"__{i}_0.distcp": {"size": 1, "xxh3_128": "0"} for i in range(65_536 + 1)}  # MAX_FILES + 1
    (path / manifest.MANIFEST_FILE).write_text(json.dumps(_v2_body(files)))
    assert (path / manifest.MANIFEST_FILE).stat().st_size < 32 << 20
    looked_at = []
    monkeypatch.setattr(manifest, "inside", lambda directory, file: looked_at.append(file.name) or file)
    with pytest.raises(
        CheckpointIntegrityError,
        match=r"c\.ckpt/manifest\.json: lists 65537 files, more than a checkpoint may have \(65536\)",
    ):
        store.open_source(path)
    assert looked_at == [manifest.MANIFEST_FILE]


def test_the_check_of_a_manifest_stops_at_the_first_mismatch(tmp_path, monkeypatch):
    """A missing (or resized) file ends the check before any other file is looked at or hashed; a content mismatch
    ends the hashing (the files not yet started are not hashed)."""
    path = tmp_path / "c.ckpt"
    _linear_checkpoint(path)
    body = json.loads((path / manifest.MANIFEST_FILE).read_text())
    missing = {f"missing-{i:04d}": {"size": 1, "xxh3_128": "0"} for i in range(2000)}
    (path / manifest.MANIFEST_FILE).write_text(json.dumps(_v2_body({**body["files"], **missing})))
    looked_at, inside = [], manifest.inside
    monkeypatch.setattr(
        manifest, "inside", lambda directory, file: looked_at.append(file.name) or inside(directory, file)
    )
    hashed, file_digest = [], digest.file_digest
    monkeypatch.setattr(digest, "file_digest", lambda file: hashed.append(file.name) or file_digest(file))
    with pytest.raises(CheckpointIntegrityError, match=r"c\.ckpt/missing-0000: missing"):
        store.open_source(path)
    assert looked_at == [manifest.MANIFEST_FILE, *sorted(body["files"]), "missing-0000"] and hashed == []

    others = {f"other-{i:02d}": b"x" for i in range(64)}
    for name, data in others.items():
        (path / name).write_bytes(data)
    wrong = {name: {"size": 1, "xxh3_128": "0" * 32} for name in others}  # every one differs
    (path / manifest.MANIFEST_FILE).write_text(json.dumps(_v2_body({**body["files"], **wrong})))
    hashed.clear()

    def slow_digest(file: Path) -> str:
        hashed.append(file.name)
        time.sleep(0.02)
        return file_digest(file)

    monkeypatch.setattr(digest, "file_digest", slow_digest)
    with pytest.raises(CheckpointIntegrityError, match=r"c\.ckpt/other-\d\d: its content differs"):
        store.open_source(path)
    assert len(hashed) <= 2 * 8  # the calls already running when the first mismatch came (at most 8 threads)


def test_ranks_share_the_hashing_one_owner_per_file_shards_to_their_writer():
    sizes = {"__0_0.distcp": 100, "__1_0.distcp": 100, "__2_0.distcp": 100, ".metadata": 5, "meta.pt": 7}
    shares = [digest.assign(sizes, r, 2, prefer=manifest.shard_rank) for r in range(2)]
    assert shares[0] | shares[1] == set(sizes) and not shares[0] & shares[1]
    assert "__0_0.distcp" in shares[0] and "__1_0.distcp" in shares[1]
    assert digest.assign(sizes, 0, 1) == set(sizes)


# ------------------------------------------------------------------------------- 2: saves in the background
def test_async_save_is_a_boolean():
    assert MMFSDP2Strategy(async_save=True).checkpoints.async_save is True
    assert MMFSDP2Strategy().checkpoints.async_save is False
    with pytest.raises(TypeError, match="async_save must be True or False"):
        MMFSDP2Strategy(async_save="yes")


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp+hf"])
def test_async_save_refuses_the_formats_that_read_the_live_model(fmt):
    with pytest.raises(ValueError, match=f"async_save=True cannot write checkpoint_format='{re.escape(fmt)}'"):
        MMFSDP2Strategy(async_save=True, checkpoint_format=fmt)
    assert MMFSDP2Strategy(checkpoint_format=fmt).checkpoint_format == fmt


def test_background_saves_train_and_checkpoint_exactly_as_synchronous_ones(work):
    main = read_results(work, "main")
    for rank in (0, 1):
        sync, background = main[rank]["runs"]["sync"], main[rank]["runs"]["async"]
        assert background["losses"] == sync["losses"] and len(sync["losses"]) == 8
        for key in ("top", "every", "best"):
            assert background[key] == sync[key], key
        assert sync["top"]["last.ckpt"]["link"] == "step=8.ckpt"
        assert main[rank]["async_resumed_3"] == {"start": 3, "losses": sync["losses"][3:]}
    # The background writes ran while training went on, and nothing incomplete was ever visible (rank 0 looked
    # at every batch start: every checkpoint and `last`, links followed).
    assert main[0]["runs"]["async"]["pending_batches"] >= 2
    assert main[0]["runs"]["async"]["incomplete"] == []
    # Issue #38 (8): every background save of the run staged into the same buffers (the first save's, refilled),
    # on both ranks; the checkpoints above equal the synchronous run's, so no save kept an earlier save's state.
    for rank in (0, 1):
        assert main[rank]["runs"]["async"]["staged_saves"] >= 6
        assert main[rank]["runs"]["async"]["staging_buffers"] == 1
    for name in ("top/step=8.ckpt", "every/last.ckpt", "every/step=3.ckpt"):
        ours, theirs = store.open_source(work / "async" / name), store.open_source(work / "sync" / name)
        a, b = ours.read_full(list(ours.shapes)), theirs.read_full(list(theirs.shapes))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_kill_during_a_background_write_keeps_earlier_checkpoints_and_last_resumable(work):
    sync = read_results(work, "main")
    resume = [ranks["after_crash"] for ranks in sync]
    entries = resume[0]["entries"]
    # Killed while newest/step=4.ckpt was written: its partial is hidden; step=2 (whose removal by save_top_k=1
    # waited for step 4) is still there, and `last` still names it.
    newest = entries["newest"]
    assert [n for n in newest if n.startswith(".step=4.ckpt.partial-")] and not newest[
        next(n for n in newest if n.startswith("."))
    ]["complete"]
    assert {n: v for n, v in newest.items() if not n.startswith(".")} == {
        "last.ckpt": {"link": "step=2.ckpt", "complete": True},
        "step=2.ckpt": {"link": None, "complete": True},
    }
    assert entries["every"] == {
        name: {"link": None, "complete": True} for name in ("last.ckpt", "step=2.ckpt", "step=4.ckpt")
    }
    for rank in (0, 1):
        losses = sync[rank]["runs"]["sync"]["losses"]
        assert resume[rank]["newest"] == {"start": 2, "losses": losses[2:]}
        assert resume[rank]["every"] == {"start": 4, "losses": losses[4:]}


def test_a_save_in_the_background_commits_when_its_write_completes(tmp_path):
    path = tmp_path / "bg.ckpt"
    with ThreadPoolExecutor(1) as executor:
        for fmt in ("torch_dcp", "torch"):
            target = path.with_suffix(f".{fmt}")
            state = {"w": torch.ones(8)}
            future = store.save(
                {"epoch": 0, "global_step": 1, "state_dict": state}, target, fmt, EXTRA, None, background=executor
            )
            state["w"].fill_(2.0)  # training goes on: the staged copy is what is written
            future.result()
            source = store.open_source(target)
            weights = (
                source.read_full(["state_dict/w"])["state_dict/w"] if source.is_dcp else source._tensors["state_dict/w"]
            )
            assert torch.equal(weights, torch.ones(8)), fmt


class _Recording(ThreadPoolExecutor):
    """One worker; keeps the staged tensors each background write was handed."""

    def __init__(self) -> None:
        super().__init__(1)
        self.staged: list[dict[str, torch.Tensor]] = []

    def submit(self, fn, /, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        self.staged.append(dict(args[3]))  # _write(path, partial, fmt, tensors, ...)
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("fmt", ["torch_dcp", "torch"])
def test_background_saves_refill_their_staging_buffers_and_each_loads_back_exactly(tmp_path, fmt):
    """Issue #38 (8): the second save stages into the first one's buffers (no new allocation), and neither
    checkpoint holds the other's state; each is byte for byte what a synchronous save of its state writes."""
    from lightning_mm.checkpoint.writer import Staging

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)

    def checkpoint(step: int) -> dict:
        net(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
        return {
            "epoch": 0,
            "global_step": step,
            "state_dict": store.model_state(net, full=False),
            "optimizer_states": [store.optimizer_state(net, optimizer, full=False)],
        }

    staging, expected = Staging(), []
    with _Recording() as executor:
        for step in (1, 2, 3):
            state = checkpoint(step)
            expected.append({k: v.clone() for k, v in net.state_dict().items()})
            future = store.save(
                state, tmp_path / f"a{step}.ckpt", fmt, EXTRA, None, background=executor, staging=staging
            )
            future.result()  # what the strategy waits for before the next save
            store.save(state, tmp_path / f"s{step}.ckpt", fmt, EXTRA, None)  # the same state, synchronously
    pointers = [sorted(t.untyped_storage().data_ptr() for t in staged.values()) for staged in executor.staged]
    assert pointers[0] == pointers[1] == pointers[2]  # the buffers of the first save, refilled
    for step in (1, 2, 3):
        source = store.open_source(tmp_path / f"a{step}.ckpt")
        keys = [f"state_dict/{k}" for k in expected[step - 1]]
        found = source.read_full(keys) if source.is_dcp else {k: source._tensors[k] for k in keys}
        assert source.meta["global_step"] == step
        for name, value in expected[step - 1].items():
            assert torch.equal(found[f"state_dict/{name}"], value), (step, name)
        if fmt == "torch_dcp":
            ours, theirs = tmp_path / f"a{step}.ckpt", tmp_path / f"s{step}.ckpt"
            assert (ours / "__0_0.distcp").read_bytes() == (theirs / "__0_0.distcp").read_bytes()
    assert not torch.equal(expected[0]["0.weight"], expected[1]["0.weight"])


class _Opaque:
    """A hyper-parameter that a weights_only load refuses."""


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_save_refuses_what_cannot_be_written_before_anything_is_staged(tmp_path, background):
    """Issue #38 (8): a background save agrees on its refusals (a checkpoint of the other layout at the path, a meta
    that would not load weights_only) on the loop thread, as a synchronous save does, with the same one-line error,
    before anything is staged or written; only the gather of the ranks' entries and the write go to the thread."""
    state = {"epoch": 0, "global_step": 1, "state_dict": {"w": torch.ones(4)}}
    (tmp_path / "file.ckpt").write_bytes(b"x")
    with _Recording() as executor:
        with pytest.raises(
            ValueError, match=r"cannot write a torch_dcp checkpoint to .*file.ckpt: a file of the other"
        ):
            store.save(
                state, tmp_path / "file.ckpt", "torch_dcp", EXTRA, None, background=executor if background else None
            )
        unsafe = {**state, "hyper_parameters": {"thing": _Opaque()}}
        with pytest.raises(ValueError, match=r"could not be loaded safely \(weights_only\): hyper_parameters.thing \("):
            store.save(
                unsafe, tmp_path / "h.ckpt", "torch_dcp", EXTRA, None, background=executor if background else None
            )
    assert executor.staged == [] and sorted(p.name for p in tmp_path.iterdir()) == ["file.ckpt"]


def test_staging_refills_one_buffer_per_key_and_follows_changed_layouts():
    """Issue #38 (8): staging copies into buffers allocated once (the same staged tensors at the next save, their
    contents the new state, isolated from later changes); a key whose shape changes gets a new buffer, a key no
    longer saved frees its own."""
    from lightning_mm.checkpoint.writer import Staging

    state = {"a": torch.arange(6.0), "b": torch.ones(2, 3)}
    with Staging() as staging:
        first = staging.stage(state)
        state["a"].add_(10.0)
        assert torch.equal(first["a"], torch.arange(6.0))  # a copy, not a view of the live tensor
        second = staging.stage(state)
        assert second["a"] is first["a"] and torch.equal(second["a"], torch.arange(6.0) + 10.0)
        state = {"a": torch.zeros(3)}
        third = staging.stage(state)
        assert third["a"] is not first["a"] and torch.equal(third["a"], torch.zeros(3)) and set(third) == {"a"}
        assert set(staging._slots) == {"a"}


def test_sigterm_during_a_background_write_lets_it_complete_and_exits_143(tmp_path):
    proc = run(ckpt_verify_scenarios.sigterm, tmp_path, expect_ok=False)
    assert proc.returncode == 143, proc.stderr[-3000:]  # the status of a SIGTERM, not an abort at exit
    assert (tmp_path / "sigterm.pending").read_text() == str(tmp_path / "sigterm" / "step=4.ckpt")
    # The pending write completed during teardown: step 4 is in place and `last` names it; save_top_k=1's removal
    # of step 2, which waited for it, happened; nothing is left half-written.
    assert sorted(p.name for p in (tmp_path / "sigterm").iterdir()) == ["last.ckpt", "step=4.ckpt"]
    last = tmp_path / "sigterm" / "last.ckpt"
    assert last.is_symlink() and store.open_source(last).meta["global_step"] == 4
