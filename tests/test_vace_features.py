"""``lightning-mm extract-features`` on MindSpeed MM's Wan VACE feature-extraction configs
(``examples/vace/feature_extract/data.json``, ``model.json``): the features equal a re-telling of
``mindspeed_mm/tools/feature_extraction/get_vace_feature.py`` (``VACEDataset``, ``VACEFeatureExtractor``) and of
``VACEVideoProcessor`` (``mindspeed_mm/data/data_utils/video_processor.py``), written here with diffusers,
Transformers, PyAV and PIL called directly, on tiny random models saved locally and clips written here."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_extract_features import WORDS, _tokenizer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "mindspeed_corpus" / "examples" / "vace" / "feature_extract"
MAX_LENGTH = 6
VAE = dict(  # Wan's factors: 8x in space (three downsamplings), 4x in time
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=[0.1, -0.2, 0.0, 0.3],
    latents_std=[0.5, 2.0, 1.0, 1.5],
)
CAPTIONS = ["a red  clip of\tthe sea", "the slow sea", "the sea"]


def _clip(path: Path, frames: int, height: int, width: int, seed: int, mask: bool = False) -> None:
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            if mask:  # a white box (the region to generate) moving over black
                image = np.zeros((height, width, 3), np.uint8)
                image[8 : 8 + 16, 4 * i : 4 * i + 24] = 255
            else:
                image = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
                image[:, : width // 3] = (200, 40, 40)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _workdir(root: Path) -> dict[str, Path]:
    from diffusers import AutoencoderKLWan
    from PIL import Image
    from transformers import UMT5Config, UMT5EncoderModel

    data = root / "dataset"
    for sub in ("videos", "src_videos", "src_video_mask", "src_ref_images"):
        (data / sub).mkdir(parents=True)
    _clip(data / "videos" / "v1.mp4", 9, 40, 72, 1)
    _clip(data / "src_videos" / "s1.mp4", 9, 40, 72, 2)
    _clip(data / "src_video_mask" / "m1.mp4", 10, 40, 72, 0, mask=True)
    _clip(data / "videos" / "v2.mp4", 13, 64, 32, 3)  # taller than wide: upstream keeps its first 32 rows
    pixels = np.random.default_rng(4).integers(0, 255, (24, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(data / "src_ref_images" / "r1.png")
    records = [
        {
            "video": "videos/v1.mp4",
            "cap": CAPTIONS[0],
            "src_video": "src_videos/s1.mp4",
            "src_ref_images": ["src_ref_images/r1.png"],
            "src_video_mask": "src_video_mask/m1.mp4",
        },
        {
            "video": "videos/v2.mp4",
            "cap": CAPTIONS[1],
            "src_video": None,
            "src_ref_images": None,
            "src_video_mask": None,
        },
        # a control video without a mask (all ones: all reactive); no reference images as an empty list
        {
            "video": "videos/v1.mp4",
            "cap": CAPTIONS[2],
            "src_video": "src_videos/s1.mp4",
            "src_ref_images": [],
            "src_video_mask": None,
        },
    ]
    (data / "data.json").write_text(json.dumps(records))
    (root / "data.txt").write_text(f"{data},{data / 'data.json'}\n")
    torch.manual_seed(0)
    AutoencoderKLWan(**VAE).save_pretrained(root / "vae")
    config = UMT5Config(vocab_size=len(WORDS), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)
    UMT5EncoderModel(config).save_pretrained(root / "text_encoder")
    _tokenizer(root / "tokenizer")
    # MindSpeed MM's own VACE feature-extraction configs, with this test's paths
    config_json = json.loads((CORPUS / "data.json").read_text())
    param = config_json["dataset_param"]
    param["basic_parameters"]["data_path"] = str(root / "data.txt")
    param["tokenizer_config"].update(from_pretrained=str(root / "tokenizer"), model_max_length=MAX_LENGTH)
    if importlib.util.find_spec("ftfy") is None:  # basic_clean needs ftfy (tested below)
        param["text_preprocess_methods"] = [{"method": "whitespace_clean"}]
    (root / "data.json").write_text(json.dumps(config_json))
    model = json.loads((CORPUS / "model.json").read_text())
    model["ae"]["from_pretrained"] = str(root / "vae")
    model["text_encoder"]["from_pretrained"] = str(root / "text_encoder")
    (root / "model.json").write_text(json.dumps(model))
    return {"root": root, "dataset": data, "data": root / "data.json", "model": root / "model.json"}


def _run(work: dict[str, Path], out: Path, data: Path | None = None) -> int:
    from lightning_mm.cli import main

    argv = ["extract-features", "--data", str(data or work["data"]), "--model", str(work["model"])]
    return main([*argv, "--output", str(out)])


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = _workdir(tmp_path_factory.mktemp("vace"))
    work["out"] = work["root"] / "out"
    assert _run(work, work["out"]) == 0
    return work


# --- the re-telling of MindSpeed MM's get_vace_feature.py / VACEVideoProcessor -----------------------------------


def _decord_like(path: Path) -> tuple[float, np.ndarray, torch.Tensor]:
    """decord's ``get_avg_fps``, ``get_frame_timestamp`` (start, end) and frames (T, C, H, W) uint8, via PyAV."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps, base = float(stream.average_rate), float(stream.time_base)
        frames = [torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1) for f in container.decode(stream)]
    starts = np.arange(len(frames)) / fps
    stamps = np.stack([starts, starts + 1 / fps], axis=1).astype(np.float32)
    assert base > 0
    return fps, stamps, torch.stack(frames)


def _frame_ids_at(
    fps: float, stamps: np.ndarray, h: int, w: int, max_hxw: int, num_frames: int
) -> tuple[list[int], int, int]:
    """``VACEVideoProcessor._get_frameid_bbox_default`` (``keep_last: false``) with train_fps 24 and
    vae_stride [4, 8, 8] x vae_patch_size [1, 2, 2]."""
    seq_len = (max_hxw / (16 * 16)) * (1 + (num_frames - 1) / 4)
    target_fps = min(fps, 24)
    duration = stamps[-1].mean()
    area_z = min(seq_len, max_hxw / (16 * 16), (h // 16) * (w // 16))
    target_frame = min((int(duration * target_fps) - 1) // 4 + 1, int(seq_len / area_z))
    target_area_z = min(area_z, int(seq_len / target_frame))
    target_height = round(np.sqrt(target_area_z * h / w))
    target_width = int(target_area_z / target_height)
    target_frame = (target_frame - 1) * 4 + 1
    timestamps = np.linspace(0.0, target_frame / target_fps, target_frame)
    hits = (timestamps[:, None] >= stamps[None, :, 0]) & (timestamps[:, None] < stamps[None, :, 1])
    return np.argmax(hits, axis=1).tolist(), target_height * 16, target_width * 16


def _frame_ids(fps: float, stamps: np.ndarray, h: int, w: int) -> tuple[list[int], int, int]:
    """The recipe's values: max_hxw 480 * 832, num_frames 17."""
    return _frame_ids_at(fps, stamps, h, w, 480 * 832, 17)


def _video(frames: torch.Tensor, ids: list[int], size: tuple[int, int], h: int, w: int) -> torch.Tensor:
    """``reader.get_batch(ids)[:, y1:y2, x1:x2, :]``, ResizeCropVideo (bicubic, antialiased, on uint8),
    ToTensorVideo, norm_fun 0.5 / 0.5; (T, C, H, W) -> (C, T, H, W)."""
    clip = frames[ids][:, 0:h, 0:w, :]  # x1, x2, y1, y2 = 0, w, 0, h (no crop_box) on (T, C, H, W)
    h0, w0 = clip.shape[-2:]
    rh, rw = size[0] / h0, size[1] / w0
    if rh > rw:
        sh, sw, i, j = size[0], round(w0 * rh), 0, int(round(round(w0 * rh) - size[1]) / 2.0)
    else:
        sh, sw, i, j = round(h0 * rw), size[1], int(round(round(h0 * rw) - size[0]) / 2.0), 0
    clip = F.interpolate(clip, size=(sh, sw), mode="bicubic", antialias=True, align_corners=False)
    clip = clip[:, :, i : i + size[0], j : j + size[1]].float() / 255.0
    return ((clip - 0.5) / 0.5).permute(1, 0, 2, 3)


def _reference(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """``ImageProcesser.image_to_image``: PIL RGB, ToTensorVideo, norm_fun, ResizeToFill (bilinear) into a white
    canvas; [1, C, H, W] -> [C, 1, H, W]."""
    from PIL import Image

    image = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)[None].float() / 255.0
    image = (image - 0.5) / 0.5
    scale = min(size[0] / image.shape[2], size[1] / image.shape[3])
    nh, nw = int(image.shape[2] * scale), int(image.shape[3] * scale)
    canvas = torch.ones(1, 3, *size)
    top, left = (size[0] - nh) // 2, (size[1] - nw) // 2
    canvas[:, :, top : top + nh, left : left + nw] = F.interpolate(image, size=(nh, nw), mode="bilinear")
    return canvas.permute(1, 0, 2, 3)


def _expected(work: dict[str, Path], record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``VACEDataset.__getitem__`` then ``VACEFeatureExtractor._extract_single`` for one source record."""
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    root, data = work["root"], work["dataset"]
    vae = AutoencoderKLWan.from_pretrained(root / "vae").eval()
    mean, std = (torch.tensor(VAE[k]).view(1, 4, 1, 1, 1) for k in ("latents_mean", "latents_std"))

    def encode(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (vae.encode(x).latent_dist.mode() - mean) / std

    readers = [data / record[k] for k in ("src_video", "src_video_mask", "video") if isinstance(record[k], str)]
    decoded = [_decord_like(p) for p in readers]
    fps, stamps, first = decoded[0]
    length = min(len(d[2]) for d in decoded)
    ids, th, tw = _frame_ids(fps, stamps[:length], *first.shape[2:])
    clips = [_video(d[2], ids, (th, tw), *first.shape[2:])[None] for d in decoded]
    video = clips[-1]
    latents = encode(video)
    refs = [_reference(data / p, (th, tw))[None] for p in record["src_ref_images"] or []]
    if refs:
        ref_latents = encode(torch.cat(refs, dim=2))
        latents = torch.concat([ref_latents, latents], dim=2)
    src = clips[0] if record["src_video"] else torch.zeros_like(video)
    has_mask = isinstance(record["src_video_mask"], str)
    mask = torch.clamp((clips[1][:, :1] + 1) / 2, min=0, max=1) if has_mask else torch.ones_like(src)
    inactive, reactive = encode(src * (1 - mask) + 0 * mask), encode(src * mask + 0 * (1 - mask))
    context = torch.concat((inactive, reactive), dim=1)
    # rearrange(mask[0, 0], "T (H P) (W Q) -> 1 (P Q) T H W", P=8, Q=8): pixel_unshuffle's channel order
    patches = F.pixel_unshuffle(mask[0, :1].permute(1, 0, 2, 3), 8).permute(1, 0, 2, 3)[None]
    patches = F.interpolate(patches, size=((patches.shape[2] + 3) // 4, *patches.shape[3:]), mode="nearest-exact")
    if refs:
        context = torch.concat((torch.concat((ref_latents, torch.zeros_like(ref_latents)), dim=1), context), dim=2)
        patches = torch.concat((torch.zeros_like(patches[:, :, : ref_latents.shape[2]]), patches), dim=2)
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(root / "text_encoder").eval()
    tokens = tokenizer(
        " ".join(record["cap"].split()),
        max_length=MAX_LENGTH,
        padding="max_length",
        truncation=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        text = encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
    return {
        "video": latents[0],
        "prompt_ids": text[0],
        "prompt_mask": tokens.attention_mask[0],
        "vace_context": torch.concat((context, patches), dim=1)[0],
    }


def test_vace_features_equal_mindspeeds_get_vace_feature_computation(extracted: dict[str, Path]) -> None:
    out, data = extracted["out"], extracted["dataset"]
    sources = json.loads((data / "data.json").read_text())
    records = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    for source, record in zip(sources, records, strict=True):
        # `_write_data_info`: the record, its paths joined to the data.txt folder, `file` the MD5 of `cap`
        name = hashlib.md5(source["cap"].encode("UTF-8")).hexdigest() + ".pt"
        joined = copy.deepcopy(source)
        for key in ("video", "src_video", "src_video_mask"):
            joined[key] = f"{data}/{source[key]}" if isinstance(source[key], str) else None
        joined["src_ref_images"] = (
            [f"{data}/{p}" for p in source["src_ref_images"]] if source["src_ref_images"] else source["src_ref_images"]
        )
        assert record == {**joined, "file": f"features/{name}"}
        got = torch.load(out / "features" / name, weights_only=True)
        assert list(got) == ["video", "prompt_ids", "prompt_mask", "vace_context"]
        want = _expected(extracted, source)
        for key, value in want.items():
            assert got[key].shape == value.shape, key
            torch.testing.assert_close(got[key], value.to(got[key].dtype), rtol=1e-5, atol=1e-6, msg=key)
    with_refs = torch.load(out / "features" / records[0]["file"].split("/")[1], weights_only=True)
    # 32 x 64 frames, 5 of the 9 (frames 0, 1, 2, 3, 5 at 8 fps), 1 reference frame: 1 + 2 latent frames;
    # channels: inactive 4 + reactive 4 + the 64 mask patches; the mask is not all ones
    assert with_refs["vace_context"].shape == (4 + 4 + 64, 3, 4, 8)
    assert with_refs["video"].shape == (4, 3, 4, 8)
    assert 0 < with_refs["vace_context"][8:, 1:].mean() < 1


def test_migrate_names_the_command_for_mindspeeds_vace_feature_extraction_launch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_mm.cli import main

    assert main(["migrate", str(CORPUS / "feature_extraction.sh")]) == 1
    err = capsys.readouterr().err
    assert "refused (feature-extraction)" in err
    assert (
        "run `lightning-mm extract-features --data ./examples/vace/feature_extract/data.json --model "
        "./examples/vace/feature_extract/model.json --output OUT`" in err
    )


def _bad(work: dict[str, Path], tmp: Path, records: list[dict[str, Any]], **pre: Any) -> Path:
    (tmp / "bad").mkdir(exist_ok=True)
    (tmp / "bad" / "data.json").write_text(json.dumps(records))
    (tmp / "data.txt").write_text(f"{work['dataset']},{tmp / 'bad' / 'data.json'}\n")
    config = json.loads(work["data"].read_text())
    config["dataset_param"]["basic_parameters"]["data_path"] = str(tmp / "data.txt")
    config["dataset_param"]["preprocess_parameters"].update(pre)
    (tmp / "data.json").write_text(json.dumps(config))
    return tmp / "data.json"


def test_bad_vace_records_and_configs_are_refused_before_any_work(
    extracted: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = json.loads((extracted["dataset"] / "data.json").read_text())
    out = tmp_path / "out"
    no_mask_key = [good[0], {k: v for k, v in good[1].items() if k != "src_video_mask"}]
    assert _run(extracted, out, _bad(extracted, tmp_path, no_mask_key)) == 1
    err = capsys.readouterr().err
    assert "bad/data.json:2: `src_video_mask`: missing" in err and len(err.strip().splitlines()) == 1
    missing_clip = [{**good[0], "src_video": "src_videos/nothing.mp4"}]
    assert _run(extracted, out, _bad(extracted, tmp_path, missing_clip)) == 1
    assert "bad/data.json:1: `src_video` 'src_videos/nothing.mp4' does not exist" in capsys.readouterr().err
    mask_only = [{**good[0], "src_video": None}]
    assert _run(extracted, out, _bad(extracted, tmp_path, mask_only)) == 1
    assert "bad/data.json:1: `src_video_mask` without `src_video`" in capsys.readouterr().err
    wrong_mask = [{**good[0], "src_video_mask": "videos/v2.mp4"}]  # 32 x 64, the control video is 72 x 40
    assert _run(extracted, out, _bad(extracted, tmp_path, wrong_mask)) == 1
    assert "bad/data.json:1: `src_video_mask` is 32x64, its `src_video` 72x40" in capsys.readouterr().err
    assert _run(extracted, out, _bad(extracted, tmp_path, good, num_frames=16)) == 1
    assert "`dataset_param.preprocess_parameters.num_frames`: 16: must be 4k + 1" in capsys.readouterr().err
    assert _run(extracted, out, _bad(extracted, tmp_path, good, max_hxw=1000)) == 1
    assert "`dataset_param.preprocess_parameters.max_hxw`: 1000" in capsys.readouterr().err
    same_caption = [good[0], {**good[1], "cap": good[0]["cap"]}]
    assert _run(extracted, out, _bad(extracted, tmp_path, same_caption)) == 1
    assert "bad/data.json:2: its feature file" in capsys.readouterr().err
    _clip(extracted["dataset"] / "videos" / "short.mp4", 1, 32, 32, 5)
    short = [{**good[1], "video": "videos/short.mp4"}]
    assert _run(extracted, out, _bad(extracted, tmp_path, short)) == 1
    assert "bad/data.json:1: `video`: 1 frame(s) (0.062 s): too short for one latent frame" in capsys.readouterr().err
    data = _bad(extracted, tmp_path, good)
    config = json.loads(data.read_text())
    config["dataset_param"]["preprocess_parameters"]["train_pipeline"]["video"][0]["trans_type"] = "ResizeVideo"
    data.write_text(json.dumps(config))
    assert _run(extracted, out, data) == 1
    assert "`dataset_param.preprocess_parameters.train_pipeline.video`: ['ResizeVideo'," in capsys.readouterr().err
    (tmp_path / "vae4").mkdir()
    (tmp_path / "vae4" / "config.json").write_text(json.dumps({"dim_mult": [1, 2], "temperal_downsample": [True]}))
    argv = ["extract-features", "--data", str(extracted["data"]), "--model", str(extracted["model"])]
    from lightning_mm.cli import main

    assert main([*argv, "--vae", str(tmp_path / "vae4"), "--output", str(out)]) == 1
    assert "vae4/config.json: a 2x temporal, 2x spatial VAE" in capsys.readouterr().err
    assert not out.exists()  # nothing written


def test_basic_clean_is_mindspeeds_or_refused_without_ftfy(
    extracted: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipe's ``text_preprocess_methods`` [basic_clean, whitespace_clean] (``TextProcesser.basic_clean``:
    ``ftfy.fix_text``, ``html.unescape`` twice, stripped)."""
    config = json.loads((CORPUS / "data.json").read_text())
    data = json.loads(extracted["data"].read_text())
    data["dataset_param"]["text_preprocess_methods"] = config["dataset_param"]["text_preprocess_methods"]
    (tmp_path / "data.json").write_text(json.dumps(data))
    if importlib.util.find_spec("ftfy") is None:
        assert _run(extracted, tmp_path / "out", tmp_path / "data.json") == 1
        err = capsys.readouterr().err
        assert "`dataset_param.text_preprocess_methods`: basic_clean needs the ftfy package" in err
        assert not (tmp_path / "out").exists()
    else:
        import html

        import ftfy

        from lightning_mm.diffusers.vace_features import basic_clean

        text = " a &amp;amp; b\u00c3\u00a9 "
        assert basic_clean(text) == html.unescape(html.unescape(ftfy.fix_text(text))).strip()


def _adjust_last(stamps: np.ndarray, h: int, w: int, max_hxw: int, num_frames: int) -> tuple[list[int], int, int]:
    """``VACEVideoProcessor._get_frameid_bbox_adjust_last`` (``keep_last: true``, its default), vae_stride
    [4, 8, 8] x vae_patch_size [1, 2, 2]."""
    seq_len = (max_hxw / (16 * 16)) * (1 + (num_frames - 1) / 4)
    duration = stamps[-1].mean()
    area_z = min(seq_len, max_hxw / (16 * 16), (h // 16) * (w // 16))
    target_frame = min((len(stamps) - 1) // 4 + 1, int(seq_len / area_z))
    target_area_z = min(area_z, int(seq_len / target_frame))
    target_height = round(np.sqrt(target_area_z * h / w))
    target_width = int(target_area_z / target_height)
    target_frame = (target_frame - 1) * 4 + 1
    timestamps = np.linspace(0.0, duration, target_frame)
    hits = (timestamps[:, None] >= stamps[None, :, 0]) & (timestamps[:, None] <= stamps[None, :, 1])
    return np.argmax(hits, axis=1).tolist(), target_height * 16, target_width * 16


@pytest.mark.parametrize(
    ("frames", "fps", "h", "w", "max_hxw", "num_frames"),
    [
        (100, 30.0, 720, 1280, 480 * 832, 81),
        (40, 24.0, 1080, 1920, 720 * 1280, 17),
        (250, 25.0, 832, 480, 480 * 832, 81),
        (13, 24.0, 480, 832, 480 * 832, 81),  # short: the frame count follows the clip
    ],
)
def test_frames_and_size_are_vace_video_processors_for_real_clip_sizes(
    frames: int, fps: float, h: int, w: int, max_hxw: int, num_frames: int
) -> None:
    from lightning_mm.diffusers.vace_features import ClipTiming, vace_target

    starts = np.arange(frames) / fps
    stamps = np.stack([starts, starts + 1 / fps], axis=1).astype(np.float32)
    timing = ClipTiming(fps, stamps, h, w)
    ids, size = vace_target(timing, frames, max_hxw, num_frames, 24, (4, 16, 16), keep_last=True)
    want_ids, th, tw = _adjust_last(stamps, h, w, max_hxw, num_frames)
    assert (ids, size) == (want_ids, (th, tw))
    ids, size = vace_target(timing, frames, max_hxw, num_frames, 24, (4, 16, 16), keep_last=False)
    want_ids, th, tw = _frame_ids_at(fps, stamps, h, w, max_hxw, num_frames)
    assert (ids, size) == (want_ids, (th, tw)) and len(ids) % 4 == 1
