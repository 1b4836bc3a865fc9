"""Wan data as MindSpeed MM configures it: its ``feature_data.json`` read verbatim (``LengthGroupedSampler`` with
``group_data``: batches of one video size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FEATURE_JSON = ROOT / "tests" / "data" / "wan" / "feature_data.json"  # verbatim, see tests/data/wan/SOURCE.md


def _write_features(folder: Path, sizes: list[tuple[int, int, int]], with_size: bool = True) -> None:
    folder.mkdir(parents=True)
    lines = []
    for i, (frames, height, width) in enumerate(sizes):
        torch.save(
            {"video": torch.full((4, frames, height, width), float(i)), "prompt_ids": torch.randn(3, 16)},
            folder / f"{i}.pt",
        )
        record = {"file": f"{i}.pt", "cap": "a clip"}
        if with_size:  # MindSpeed MM's feature records carry the source video's size
            record["sample_size"] = f"{4 * (frames - 1) + 1}x{8 * height}x{8 * width}"
        lines.append(json.dumps(record))
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")


def _batches(loader) -> list[torch.Tensor]:
    return [batch["latents"] for batch in loader]


SIZES = [(2, 4, 4), (1, 4, 6), (2, 4, 4), (1, 4, 6), (2, 4, 4), (2, 4, 4), (1, 4, 6), (2, 4, 4)]


def test_mindspeeds_feature_data_json_groups_batches_by_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_mm.datamodules import MMDataModule

    monkeypatch.chdir(tmp_path)  # its data_path is ./sora_features/data.jsonl, relative to the working directory
    _write_features(tmp_path / "sora_features", SIZES)
    dm = MMDataModule.from_config(FEATURE_JSON, batch_size=2, seed=3)
    dm.setup("fit")
    first = _batches(dm.train_dataloader())
    # 5 samples of one size, 3 of the other: drop_last keeps 2 + 1 full batches, each of one size
    assert len(first) == 3 and all(b.shape[0] == 2 for b in first)
    assert sorted(tuple(b.shape[2:]) for b in first) == [(1, 4, 6), (2, 4, 4), (2, 4, 4)]
    seen = [(int(v), tuple(b.shape[2:])) for b in first for v in b[:, 0, 0, 0, 0]]  # (sample index, its size)
    assert len({i for i, _ in seen}) == 6 and all(SIZES[i] == size for i, size in seen)
    again = MMDataModule.from_config(FEATURE_JSON, batch_size=2, seed=3)
    again.setup("fit")
    assert all(torch.equal(a, b) for a, b in zip(first, _batches(again.train_dataloader())))  # same seed, same order


def test_grouped_batches_give_every_rank_the_same_steps() -> None:
    from lightning_mm.datamodules.grouped_sampler import GroupedDistributedSampler, plan_grouped_batches

    keys = ["a", "b", "a", "b", "a", "a", "b", "a", "c"]
    for drop_last in (True, False):
        plan = plan_grouped_batches(keys, 2, 2, seed=0, epoch=1, shuffle=True, drop_last=drop_last)
        assert len(plan) % 2 == 0 and all(len({keys[i] for i in batch}) == 1 and len(batch) == 2 for batch in plan)
        ranks_again = []
        for r in range(2):
            sampler = GroupedDistributedSampler(keys, keys, 2, num_replicas=2, rank=r, seed=0, drop_last=drop_last)
            sampler.set_epoch(1)
            ranks_again.append(list(sampler))
        assert len(ranks_again[0]) == len(ranks_again[1]) and ranks_again == [sum(plan[r::2], []) for r in range(2)]
    one_rank = sum(plan_grouped_batches(keys, 2, 1, 0, 0, True, True), [])  # a: 2 of 5 batches, b: 1 of 3, c: none
    assert len(one_rank) == len(set(one_rank)) == 6 and 8 not in one_rank
    padded = plan_grouped_batches(keys, 2, 1, 0, 0, True, False)  # short batches filled from their own group
    assert len(padded) == 6 and sorted(set(sum(padded, []))) == list(range(9))


def test_the_grouping_keys_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_mm.data.data_config import DataConfigError
    from lightning_mm.datamodules import MMDataModule

    monkeypatch.chdir(tmp_path)
    _write_features(tmp_path / "sora_features", SIZES, with_size=False)  # keys from the latents' shapes instead
    dm = MMDataModule.from_config(FEATURE_JSON, batch_size=2, seed=3)
    dm.setup("fit")
    assert sorted(tuple(b.shape[2:]) for b in _batches(dm.train_dataloader())) == [(1, 4, 6), (2, 4, 4), (2, 4, 4)]
    base = json.loads(FEATURE_JSON.read_text())
    cases = {
        "group_resolution": ({"group_resolution": True, "group_data": False}, "group_resolution"),
        "both": ({"group_frame": True}, "group_data`: cannot be true with group_frame"),
        "sampler": ({"sampler_type": "stateful_distributed_sampler"}, "LengthGroupedSampler only"),
        "step": ({"initial_global_step_for_sampler": 4}, "initial_global_step_for_sampler"),
    }
    for name, (change, message) in cases.items():
        data = json.loads(json.dumps(base))
        data["dataloader_param"].update(change)
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        with pytest.raises(DataConfigError, match=message):
            MMDataModule.from_config(tmp_path / f"{name}.json")


# ------------------------------------------------------------------------------------ raw videos
VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[True],
    latents_mean=[0.1, -0.2, 0.0, 0.3],
    latents_std=[0.5, 2.0, 1.0, 1.5],
)


def _write_clip(path: Path, frames: int, height: int, width: int) -> None:
    import av
    import numpy as np

    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            image = np.zeros((height, width, 3), np.uint8)
            image[:, : width // 2] = (200, 40, 40)
            image[4 * i : 4 * i + 12, 8:24] = rng.integers(0, 255, (12, 16, 3))
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _video_config(tmp_path: Path, num_frames: int = 5, **basic) -> Path:
    from diffusers import AutoencoderKLWan

    folder = tmp_path / "clips"
    folder.mkdir(exist_ok=True)
    _write_clip(folder / "clip.mp4", 7, 48, 64)
    torch.save({"prompt_ids": torch.randn(3, 16, generator=torch.Generator().manual_seed(1))}, folder / "text.pt")
    (folder / "data.jsonl").write_text(json.dumps({"path": "clip.mp4", "file": "text.pt", "cap": "a clip"}) + "\n")
    if not (tmp_path / "vae").is_dir():
        torch.manual_seed(0)
        AutoencoderKLWan(**VAE).save_pretrained(tmp_path / "vae")
    data = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {
                "data_path": str(folder / "data.jsonl"),
                "data_folder": str(folder),
                "vae_path": str(tmp_path / "vae"),
                **basic,
            },
            "preprocess_parameters": {
                "num_frames": num_frames,
                "frame_interval": 1,
                "max_height": 32,
                "max_width": 32,
                "train_fps": 24,
            },
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False},
    }
    path = tmp_path / f"video_{num_frames}.json"
    path.write_text(json.dumps(data))
    return path


def test_a_video_record_is_decoded_resized_and_encoded_by_the_frozen_vae(tmp_path: Path) -> None:
    import imageio.v3 as iio
    from diffusers import AutoencoderKLWan

    from lightning_mm.data.wan_video import read_frames
    from lightning_mm.datamodules import MMDataModule

    dm = MMDataModule.from_config(_video_config(tmp_path), batch_size=1)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    clip = tmp_path / "clips" / "clip.mp4"
    direct = torch.from_numpy(iio.imread(clip, plugin="pyav"))  # (7, 48, 64, 3), read by imageio
    assert direct.shape == (7, 48, 64, 3) and torch.equal(read_frames(clip, 5), direct[:5])
    # MindSpeed MM's pipeline by hand: short side to 32 (48x64 -> 32x43), centre crop 32x32, [-1, 1]
    video = torch.nn.functional.interpolate(
        direct[:5].permute(0, 3, 1, 2).float(), size=(32, 43), mode="bilinear", antialias=True
    )[..., 5:37]
    video = (video / 127.5 - 1.0).permute(1, 0, 2, 3)[None]
    vae = AutoencoderKLWan.from_pretrained(tmp_path / "vae").eval()
    with torch.no_grad():
        mode = vae.encode(video).latent_dist.mode()
    expected = (mode - torch.tensor(VAE["latents_mean"]).view(1, 4, 1, 1, 1)) / torch.tensor(VAE["latents_std"]).view(
        1, 4, 1, 1, 1
    )
    assert batch["latents"].shape == expected.shape == (1, 4, 3, 16, 16)
    torch.testing.assert_close(batch["latents"], expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(batch["prompt_embeds"][0], torch.load(tmp_path / "clips" / "text.pt")["prompt_ids"])
    assert not any(p.requires_grad for p in dm._splits["train"].video.vae.vae.parameters())  # frozen, not trained


def test_video_records_are_checked(tmp_path: Path) -> None:
    from lightning_mm.data.data_config import DataConfigError
    from lightning_mm.data.record_files import DataError
    from lightning_mm.datamodules import MMDataModule

    path = _video_config(tmp_path)
    data = json.loads(path.read_text())
    data["dataset_param"]["basic_parameters"]["vae_path"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(DataConfigError, match="basic_parameters.vae_path`: missing"):
        MMDataModule.from_config(path).setup("fit")
    # Without vae_path a record's `path` is MindSpeed MM's metadata (the source video), not read: the text-only
    # feature file then has no latents, which the error names.
    del data["dataset_param"]["basic_parameters"]["vae_path"]
    path.write_text(json.dumps(data))
    dm = MMDataModule.from_config(path, batch_size=1)
    dm.setup("fit")
    with pytest.raises(DataError, match="no feature record could be read"):
        next(iter(dm.train_dataloader()))
    assert "record's `path` is a video to encode" in dm.reports["train"].problems[0]
    # Too short for num_frames: a bad record when the dataset is set up (here the only one), not mid-epoch.
    with pytest.raises(DataError, match=r"data.jsonl:1: video 'clip.mp4': 7 frame\(s\), num_frames 9 .* needs 9"):
        MMDataModule.from_config(_video_config(tmp_path, num_frames=9), batch_size=1).setup("fit")


def _bad_video_config(tmp_path: Path, strict: bool = False) -> Path:
    """Five video records: good, empty, not a video, too short (3 frames for num_frames 5), good."""
    path = _video_config(tmp_path)
    folder = tmp_path / "clips"
    (folder / "empty.mp4").write_bytes(b"")
    (folder / "noise.mp4").write_bytes(bytes(range(256)) * 64)
    _write_clip(folder / "short.mp4", 3, 48, 64)
    lines = [
        json.dumps({"path": name, "file": "text.pt"})
        for name in ("clip.mp4", "empty.mp4", "noise.mp4", "short.mp4", "clip.mp4")
    ]
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    data = json.loads(path.read_text())
    data["strict"] = strict
    path.write_text(json.dumps(data))
    return path


def test_bad_video_records_are_counted_and_skipped_when_the_dataset_is_set_up(tmp_path: Path) -> None:
    """Empty, undecodable and too-short clips are found by the probe at setup, with file and line; the epoch then
    reads only good records. In strict mode they are an error at setup."""
    from lightning_mm.data.record_files import DataError
    from lightning_mm.datamodules import MMDataModule

    dm = MMDataModule.from_config(_bad_video_config(tmp_path), batch_size=1)
    with pytest.warns(UserWarning, match="3 skipped"):
        dm.setup("fit")
    jsonl = tmp_path / "clips" / "data.jsonl"
    problems = dm.reports["train"].problems
    assert [p.split(": ")[0] for p in problems] == [f"{jsonl}:2", f"{jsonl}:3", f"{jsonl}:4"]
    assert "video 'empty.mp4': not a readable video" in problems[0]
    assert "video 'noise.mp4': not a readable video" in problems[1]
    assert "video 'short.mp4': 3 frame(s), num_frames 5 at frame_interval 1 needs 5" in problems[2]
    assert len(dm._splits["train"]) == 2 and len(list(dm.train_dataloader())) == 2
    with pytest.raises(DataError, match=r"(?s)bad records in strict mode .*data.jsonl:2: video 'empty.mp4'"):
        MMDataModule.from_config(_bad_video_config(tmp_path, strict=True), batch_size=1).setup("fit")


def test_a_video_that_fails_when_read_is_replaced_and_counted(tmp_path: Path) -> None:
    """A clip that passed the probe but fails when read (here: replaced by noise after setup) does not end the
    epoch: the next good record takes its place, and the report names its file and line."""
    from lightning_mm.datamodules import MMDataModule

    path = _video_config(tmp_path)
    folder = tmp_path / "clips"
    _write_clip(folder / "later.mp4", 7, 48, 64)
    lines = [json.dumps({"path": name, "file": "text.pt"}) for name in ("later.mp4", "clip.mp4")]
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    dm = MMDataModule.from_config(path, batch_size=1)
    dm.setup("fit")
    (folder / "later.mp4").write_bytes(bytes(range(256)) * 64)
    with pytest.warns(UserWarning, match="data.jsonl:1: cannot process the record: .*later.mp4: not a readable"):
        batches = list(dm.train_dataloader())
    assert len(batches) == 2 and torch.equal(batches[0]["latents"], batches[1]["latents"])  # clip.mp4 twice
    assert dm.reports["train"].skipped == 1


def test_resizing_frame_by_frame_is_the_whole_clip_resize_bit_for_bit() -> None:
    """The banded, per-frame resize equals MindSpeed MM's whole-clip ``interpolate`` (bilinear, antialiased)."""
    from lightning_mm.data.wan_video import to_model_frames

    torch.manual_seed(0)
    for frames, height, width in (((3, 48, 64, 3), 32, 32), ((2, 217, 301, 3), 40, 56), ((2, 20, 30, 3), 32, 48)):
        clip = torch.randint(0, 256, frames, dtype=torch.uint8)
        h, w = frames[1:3]
        scale = max(height / h, width / w)
        size = (max(height, round(h * scale)), max(width, round(w * scale)))
        whole = torch.nn.functional.interpolate(
            clip.permute(0, 3, 1, 2).float(), size=size, mode="bilinear", antialias=True, align_corners=False
        )
        top, left = (size[0] - height) // 2, (size[1] - width) // 2
        expected = ((whole[..., top : top + height, left : left + width] / 255.0 - 0.5) / 0.5).permute(1, 0, 2, 3)
        assert torch.equal(to_model_frames(clip, height, width), expected)


_PEAK = """
import resource, sys, torch
from lightning_mm.data.wan_video import decode_model_frames
decode_model_frames(sys.argv[2], 2, 1, 16, 16)  # codecs and allocator warmed up on a small clip
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = decode_model_frames(sys.argv[1], 4, 1, 32, 32)
assert out.shape == (3, 4, 32, 32)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_4k_clip_read_into_a_small_sample_stays_within_a_frames_memory(tmp_path: Path) -> None:
    """Four 3840x2160 frames into a 32x32 sample: the peak grows by about one frame's uint8 pixels (25 MB), not
    by the clip at full resolution in float32 (4 x 99.5 MB, and more for the resize), measured as the process's
    peak resident memory in a fresh process."""
    import subprocess
    import sys

    _write_clip(tmp_path / "uhd.mp4", 4, 2160, 3840)
    _write_clip(tmp_path / "small.mp4", 3, 48, 64)
    result = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / "uhd.mp4"), str(tmp_path / "small.mp4")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    grown_mb = int(result.stdout.split()[-1])
    assert grown_mb < 150, grown_mb


def test_frames_larger_than_the_documented_limit_are_refused(tmp_path: Path) -> None:
    from lightning_mm.data.wan_video import MAX_SOURCE_SIDE, _too_large, probe_video

    assert MAX_SOURCE_SIDE == 8192
    assert _too_large(3840, 2160) is None
    assert "8200x16 frames; the largest source side is 8192 pixels" in str(_too_large(8200, 16))
    _write_clip(tmp_path / "ok.mp4", 3, 48, 64)
    assert probe_video(tmp_path / "ok.mp4", 3) is None
    assert probe_video(tmp_path / "ok.mp4", 2, frame_interval=2) is None  # frames 0 and 2 of 3
    assert "3 frame(s), num_frames 2 at frame_interval 3 needs 4" in str(probe_video(tmp_path / "ok.mp4", 2, 3))
