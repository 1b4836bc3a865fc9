"""Video samples of MindSpeed MM's Qwen-VL templates equal MindSpeed MM's own (its FSDP2 route, commit 57069cd5).

The reference (``tests/helpers/mindspeed_reference.py``, the video part) re-tells MindSpeed MM's
``mindspeed_mm/fsdp/data/data_utils/func_utils/mm_plugin.py`` (``MMPluginMixin._get_video_sample_indices``,
``Qwen2VLPlugin._regularize_videos`` with its even-frame rule and ``fps_per_video``, ``_preprocess_image`` of each
frame with the video bounds, the plugins' ``_get_mm_inputs`` and ``process_messages`` for ``<video>``) and, since
Transformers 5.24's video processors import torchvision (which the CPU torch build cannot load), Transformers'
``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor`` (``sample_frames``, ``smart_resize``, torchvision's uint8
bicubic resize, the fused normalisation, ``patchify``) and uses Transformers' own ``Qwen3VLProcessor.
_calculate_timestamps``. The patch layout and normalisation are also checked against Transformers' own image
processor (PIL backend) on a two-frame clip of one picture, where a video is that picture's image patches.
Clips are generated with PyAV: 64x48 and 300x200, 7 to 12 frames, 5 and 10 fps.
"""

from __future__ import annotations

import fractions
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_mm.testing.tiny_vlms import write_tiny_vlm
from tests.helpers.mindspeed_reference import ref_get_video_sample_indices
from tests.helpers.mindspeed_reference import reference as _ms_reference
from tests.test_native_route import _tiny_qwen3_5

MAX_PIXELS = 64 * 64
MIN_PIXELS = 32 * 32
VIDEO = {"video_fps": 2.0, "video_maxlen": 6, "video_max_pixels": 56 * 56, "video_min_pixels": 16 * 16}
CLIPS = {"small.mp4": (64, 48, 7, 5), "big.mp4": (300, 200, 12, 10), "odd.mp4": (40, 30, 9, 3)}
ATTR = {
    "images": "images",
    "videos": "videos",
    "messages": "messages",
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
}
FAMILY_OF = {
    "qwen2vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_nothink": "qwen3_vl",
    "qwen2_omni": "qwen2_5_omni_thinker",
    "qwen3_6": "qwen3_5",
}


def write_clip(path: Path, width: int, height: int, frames: int, fps: int, seed: int = 0) -> None:
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fractions.Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _record(turns: list[tuple[str, str]], videos: list[str], images: list[str] | None = None) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns], "videos": videos, "images": images or []}


RECORDS = {
    "small clip": _record([("user", "<video>What happens?"), ("assistant", "Noise.")], ["small.mp4"]),
    "large clip": _record([("user", "Describe <video> please."), ("assistant", "Colours.")], ["big.mp4"]),
    "odd frame count": _record([("user", "<video>"), ("assistant", "Nine frames.")], ["odd.mp4"]),
    "video and image": _record(
        [("user", "<image>and<video>"), ("assistant", "Both."), ("user", "More?"), ("assistant", "No.")],
        ["small.mp4"],
        ["pic.png"],
    ),
    "two clips": _record([("user", "<video><video>Same?"), ("assistant", "Yes.")], ["small.mp4", "small.mp4"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("video")
    from lightning_mm.testing.tiny_families import write_tiny_family

    out = {f: write_tiny_vlm(root / f, f) for f in ("qwen2_5_vl", "qwen3_vl")}
    out["qwen2_5_omni_thinker"] = write_tiny_family(root / "omni", "qwen2_5_omni_thinker")
    out["qwen3_5"] = _tiny_qwen3_5(root / "qwen3_5")  # Qwen3-VL's processor, a Qwen3.5 model (Gated DeltaNet)
    for family in ("qwen3_vl", "qwen3_5"):  # a video processor config as the real checkpoints ship it
        (out[family] / "video_preprocessor_config.json").write_text(
            json.dumps({"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 2}, "fps": 2, "min_frames": 2})
        )
    return out


def _dataset(tmp: Path, monkeypatch, model: Path, name: str, records: list[dict], video: dict, basic=None):
    from PIL import Image

    from lightning_mm import MMDataModule

    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for clip, spec in CLIPS.items():
        write_clip(data / clip, *spec)
    pixels = torch.randint(0, 256, (40, 60, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(data / "pic.png")
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pre = {"model_name_or_path": str(model), "image_max_pixels": MAX_PIXELS, "image_min_pixels": MIN_PIXELS, **video}
    config = {
        "dataset_param": {
            "dataset_type": "huggingface",
            "preprocess_parameters": pre,
            "basic_parameters": {"template": name, "dataset_dir": "./data", "dataset": "./data/train.jsonl"}
            | (basic or {}),
            "attr": ATTR,
        },
        "dataloader_param": {"dataloader_mode": "sampler", "collate_param": {}},
        "strict": True,
    }
    (tmp / "data.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp)
    module = MMDataModule(data_config=tmp / "data.json")
    module.setup()
    return module, data


def _assert_same(sample: dict, ref: dict) -> None:
    assert set(sample) == set(ref), (sorted(sample), sorted(ref))
    for key, value in ref.items():
        assert sample[key].shape == value.shape, (key, sample[key].shape, value.shape)
        assert torch.equal(sample[key], value.to(sample[key].dtype)), key


@pytest.mark.parametrize("name", list(FAMILY_OF))
@pytest.mark.parametrize("video", [VIDEO, dict(VIDEO, video_fps=4.0, video_maxlen=5)], ids=["2fps", "4fps"])
def test_video_samples_equal_mindspeed_mm(name, video, models, tmp_path, monkeypatch):
    model = models[FAMILY_OF[name]]
    module, data = _dataset(tmp_path, monkeypatch, model, name, list(RECORDS.values()), video)
    dataset = module._splits["train"]
    for i, (what, record) in enumerate(RECORDS.items()):
        ref = _ms_reference(model, name, record, data, MAX_PIXELS, MIN_PIXELS, video=video)
        try:
            _assert_same(dataset[i], ref)
        except AssertionError as err:
            raise AssertionError(f"{name}, {what}: {err}") from None
    if name == "qwen2vl":  # Qwen2.5-VL takes the seconds per temporal patch (mRoPE's time axis)
        assert "second_per_grid_ts" in dataset[0]
    collate = module.train_dataloader().collate_fn
    batch = collate([dataset[0], dataset[3]])
    assert batch["video_grid_thw"].shape == (2, 3) and torch.equal(batch["pixel_values"], dataset[3]["pixel_values"])
    # MindSpeed MM's collator adds its filler image only to a batch with neither images nor videos
    assert "pixel_values" not in collate([dataset[0]]) and "pixel_values_videos" in collate([dataset[0]])


@pytest.mark.parametrize(
    "spec", [(64, 48, 7, 5), (300, 200, 12, 10), (40, 30, 9, 3), (32, 32, 40, 25)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("fps,maxlen", [(2.0, 128), (4.0, 5), (0.5, 3)])
def test_frames_are_sampled_as_mindspeed_mm(spec, fps, maxlen, tmp_path):
    import av

    from lightning_mm.hf.video_frames import decode_video

    path = tmp_path / "clip.mp4"
    write_clip(path, *spec)
    got = decode_video(path, fps, maxlen)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        indices = ref_get_video_sample_indices(stream, fps, maxlen)
        frames = [f.to_ndarray(format="rgb24") for i, f in enumerate(container.decode(stream)) if i in indices]
        seconds = float(stream.duration * stream.time_base)
    if len(frames) % 2:
        frames.append(frames[-1])
    assert len(got.frames) == len(frames) and len(got.frames) % 2 == 0
    for ours, theirs in zip(got.frames, frames):
        assert np.array_equal(np.asarray(ours), theirs)
    assert got.fps == len(indices) / seconds


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_patches_equal_the_image_processors_on_a_still_clip(family, models):
    """Two frames of one picture at a size the processors keep: the video's patches are the picture's image
    patches from Transformers' own image processor (which repeats a picture over the temporal patch)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from lightning_mm.hf.qwen_video import QwenVideoProcessor, QwenVideoSettings

    image_processor = AutoImageProcessor.from_pretrained(models[family])
    factor = image_processor.patch_size * image_processor.merge_size
    pixels = torch.randint(0, 256, (factor * 2, factor * 3, 3), generator=torch.Generator().manual_seed(1))
    picture = Image.fromarray(pixels.to(torch.uint8).numpy())
    expected = image_processor([picture], return_tensors="pt")
    settings = QwenVideoSettings(
        "qwen3_vl" if family == "qwen3_vl" else "qwen2_vl",
        shortest_edge=factor * factor,
        longest_edge=factor * factor * 64,
        patch_size=image_processor.patch_size,
        image_mean=tuple(image_processor.image_mean),
        image_std=tuple(image_processor.image_std),
    )
    got = QwenVideoProcessor(settings)([[picture, picture]])
    assert torch.equal(got["video_grid_thw"], expected["image_grid_thw"])
    torch.testing.assert_close(got["pixel_values_videos"], expected["pixel_values"], rtol=0, atol=2e-6)
    # Frames in order: the second frame's pixels sit in the second half of each temporal patch.
    black = Image.new("RGB", picture.size)
    mixed = QwenVideoProcessor(settings)([[picture, black]])["pixel_values_videos"]
    half = mixed.shape[1] // (2 * 3)
    per_channel = mixed.view(mixed.shape[0], 3, 2, half)
    torch.testing.assert_close(per_channel[:, :, 0], expected["pixel_values"].view(mixed.shape[0], 3, 2, half)[:, :, 0])


def test_glm_videos_are_refused_by_name(tmp_path, monkeypatch):
    from lightning_mm.data.record_files import DataError
    from lightning_mm.testing.tiny_families import write_tiny_family

    model = write_tiny_family(tmp_path / "glm4v", "glm4v")
    with pytest.raises(DataError, match="GLM4VPlugin.*total_frames"):
        _dataset(tmp_path, monkeypatch, model, "glm4.1v", [RECORDS["small clip"]], VIDEO)


def test_videos_with_the_models_own_chat_template_are_refused(models, tmp_path, monkeypatch):
    from lightning_mm.data.record_files import DataError

    with pytest.raises(DataError, match="only with MindSpeed MM's templates"):
        _dataset(tmp_path, monkeypatch, models["qwen2_5_vl"], None, [RECORDS["small clip"]], VIDEO)


def test_bad_video_records_and_keys_are_named(models, tmp_path, monkeypatch):
    from lightning_mm.data.data_config import DataConfigError
    from lightning_mm.data.record_files import DataError

    model = models["qwen2_5_vl"]
    bad = _record([("user", "<video><video>"), ("assistant", "x")], ["small.mp4"])
    with pytest.raises(DataError, match="2 <video> placeholders for 1 videos"):
        _dataset(tmp_path, monkeypatch, model, "qwen2vl", [bad], VIDEO)
    with pytest.raises(DataError, match="video .no.mp4. is not a file in dataset_dir"):
        _dataset(
            tmp_path,
            monkeypatch,
            model,
            "qwen2vl",
            [_record([("user", "<video>"), ("assistant", "x")], ["no.mp4"])],
            VIDEO,
        )
    with pytest.raises(DataConfigError, match="video_fps"):
        _dataset(tmp_path, monkeypatch, model, "qwen2vl", [RECORDS["small clip"]], dict(VIDEO, video_fps=0))
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "broken.mp4").write_bytes(b"not a video")
    broken = _record([("user", "<video>"), ("assistant", "x")], ["broken.mp4"])
    with pytest.raises(DataError, match="broken.mp4: cannot open the video"):
        _dataset(tmp_path, monkeypatch, model, "qwen2vl", [broken], VIDEO)
    module, data = _dataset(tmp_path, monkeypatch, model, "qwen2vl", [RECORDS["small clip"]], VIDEO)
    (data / "small.mp4").write_bytes(b"not a video")
    with pytest.raises(DataError, match="cannot decode the video"):
        module._splits["train"][0]


def _loss_and_step(model: Any, batch: dict, lr: float = 0.5) -> tuple[float, float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model(**batch).loss
    return float(loss.detach()), float(after)


@pytest.mark.parametrize(
    "name,cls",
    [
        ("qwen2vl", "Qwen2_5_VLForConditionalGeneration"),
        ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
        ("qwen3_6", "Qwen3_5ForConditionalGeneration"),
    ],
)
def test_a_training_step_on_a_video_equals_plain_transformers(name, cls, models, tmp_path, monkeypatch):
    """One SGD step on a video batch through ``TransformersModel`` equals plain Transformers on the same
    ``pixel_values_videos`` / ``video_grid_thw`` (/ ``second_per_grid_ts``, Qwen2.5-VL; ``mm_token_type_ids``),
    and the video changes the loss."""
    import transformers

    from lightning_mm.modules import TransformersModel

    model_dir = models[FAMILY_OF[name]]
    module, _ = _dataset(tmp_path, monkeypatch, model_dir, name, [RECORDS["small clip"]], VIDEO)
    batch = module.train_dataloader().collate_fn([module._splits["train"][0]])
    assert {"pixel_values_videos", "video_grid_thw", "mm_token_type_ids"} <= set(batch)
    assert ("second_per_grid_ts" in batch) == (name == "qwen2vl")
    ours = TransformersModel({"init_from_hf_path": str(model_dir)}).train()
    plain = getattr(transformers, cls).from_pretrained(str(model_dir), dtype=torch.float32)
    got, expected = _loss_and_step(ours, batch), _loss_and_step(plain.train(), batch)
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (got, expected)
    assert got[1] < got[0]
    other = dict(batch, pixel_values_videos=torch.zeros_like(batch["pixel_values_videos"]))
    with torch.no_grad():
        assert float(plain(**other).loss) != pytest.approx(float(plain(**batch).loss), rel=1e-6)


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # the PyPI wheel with the CPU torch: "operator torchvision::nms does not exist"
        return False
    return True


@pytest.mark.skipif(not _torchvision_loads(), reason="torchvision does not load with this torch build")
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_video_processing_equals_transformers_video_processor_where_torchvision_loads(kind):
    """Where torchvision loads, Transformers' own video processor on the same frames and metadata."""
    import dataclasses

    import transformers
    from PIL import Image

    from lightning_mm.hf.qwen_video import QwenVideoProcessor, QwenVideoSettings

    rng = np.random.default_rng(3)
    frames = [Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)) for _ in range(6)]
    size = {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 2}
    if kind == "qwen2_vl":
        theirs = transformers.Qwen2VLVideoProcessor(size=size, cap_pixels_per_frame=False)
        expected = theirs(videos=[frames], return_tensors="pt")
        settings = QwenVideoSettings(kind, size["shortest_edge"], size["longest_edge"], 14)
    else:
        theirs = transformers.Qwen3VLVideoProcessor(size=size, fps=2, min_frames=2, cap_pixels_per_frame=False)
        metadata = [{"fps": 4.0, "duration": 6, "total_num_frames": 6}]
        expected = theirs(videos=[frames], video_metadata=metadata, return_metadata=True)
        settings = QwenVideoSettings(
            kind, size["shortest_edge"], size["longest_edge"], 16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3
        )
        settings = dataclasses.replace(settings, do_sample_frames=True, fps=2, min_frames=2)
    got = QwenVideoProcessor(settings)([frames], metadata_fps=4.0)
    assert torch.equal(got["video_grid_thw"], expected["video_grid_thw"])
    assert torch.equal(got["pixel_values_videos"], expected["pixel_values_videos"])
    if kind == "qwen3_vl":
        assert list(got["frames_indices"][0]) == list(expected["video_metadata"][0].frames_indices)


@pytest.mark.parametrize(
    "name,cls",
    [
        ("qwen2vl", "Qwen2_5_VLForConditionalGeneration"),
        ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
        ("qwen2_omni", "Qwen2_5OmniThinkerForConditionalGeneration"),
    ],
)
def test_packed_video_rows_equal_plain_transformers_unpacked(name, cls, models, tmp_path, monkeypatch):
    """Video samples from the sample builder (``neat_packing``), packed by the data module's own collate function:
    a row of videos only (no filler image: MindSpeed MM adds it only to a batch with neither images nor videos)
    and a row of a video-and-image sample with a video sample train exactly as plain Transformers on the samples
    padded (``tests/test_packing.py``'s harness; each video's seconds per temporal patch, where the model takes
    them, reach its own sample's M-RoPE positions)."""
    import transformers

    from lightning_mm.modules import TransformersModel
    from tests.test_packing import assert_packed_equals_unpacked

    model_dir = models[FAMILY_OF[name]]
    records = [RECORDS[k] for k in ("small clip", "two clips", "video and image", "large clip")]
    basic = {"neat_packing": True, "cutoff_len": 4096}
    module, _ = _dataset(tmp_path, monkeypatch, model_dir, name, records, VIDEO, basic=basic)
    collate = module.train_dataloader().collate_fn
    assert collate.filler is not None and "pixel_values" in collate.filler
    samples = [module._splits["train"][i] for i in range(len(records))]
    ours = TransformersModel({"init_from_hf_path": str(model_dir)}).train()
    plain = getattr(transformers, cls).from_pretrained(str(model_dir), dtype=torch.float32).train()
    for row in (samples[:2], samples[2:]):
        assert_packed_equals_unpacked(ours, plain, row, collate)
    assert "pixel_values" not in collate(samples[:2])
    if name == "qwen2vl":
        assert "second_per_grid_ts" in samples[0]
    elif name == "qwen2_omni":
        assert "video_second_per_grid" in samples[0]


LONG = _record(
    [
        ("user", "<video>What happens in this clip?"),
        ("assistant", "Random noise, frame after frame."),
        ("user", "And then? Tell me about every frame, one by one, in order."),
        ("assistant", "Still noise: the first frame, the second frame, and so on to the end."),
    ],
    ["big.mp4"],
)


@pytest.mark.parametrize("name", list(FAMILY_OF))
@pytest.mark.parametrize("video", [VIDEO, dict(VIDEO, video_fps=4.0, video_maxlen=5)], ids=["2fps", "4fps"])
def test_video_lengths_equal_the_built_samples_and_decode_no_frame(name, video, models, tmp_path, monkeypatch):
    """Token-budget lengths of video records (``lightning_mm.hf.chat_lengths.video_layout``: the container's frame
    count and size, no frame decoded) equal the built samples' (which equal MindSpeed MM's re-told samples, above):
    one and two clips, odd frame counts, a clip with an image, several turns; uncut, and cut by ``cutoff_len`` in the
    last turns (``infer_seqlen``) of the longest record."""
    import lightning_mm.hf.video_frames as video_frames
    from lightning_mm.datamodules.token_budget_loader import sample_lengths

    records = [*RECORDS.values(), LONG]
    model = models[FAMILY_OF[name]]
    full = None
    for cut in (None, 5):
        basic = None if full is None else {"cutoff_len": max(full) - cut}
        module, _ = _dataset(tmp_path, monkeypatch, model, name, records, video, basic)
        dataset = module._splits["train"]
        decoded: list[Any] = []

        def counting(*args: Any, _seen: list[Any] = decoded, _decode: Any = video_frames.decode_video) -> Any:
            _seen.append(args)
            return _decode(*args)

        monkeypatch.setattr(video_frames, "decode_video", counting)
        lengths = sample_lengths(dataset)
        assert decoded == []  # no frame decoded to plan
        built = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        assert decoded  # building decodes them
        assert lengths == built, (name, cut)
        if full is None:
            full = built
            assert max(full) == full[-1] and len(set(full)) > 3
        else:
            assert built[-1] == max(full) - cut and built[:-1] == full[:-1]
        monkeypatch.undo()
