"""Wan VACE feature extraction as MindSpeed MM's ``mindspeed_mm/tools/feature_extraction/get_vace_feature.py``
(its ``VACEDataset`` and ``VACEFeatureExtractor``, with ``VACEVideoProcessor`` of
``mindspeed_mm/data/data_utils/video_processor.py``) computes it, without Lightning.

Per record (``video``, ``cap`` and the optional ``src_video`` control video, ``src_video_mask`` and
``src_ref_images``), ``OUT/features/<md5 of cap>.pt`` holds:

- ``video``: the target video's latents (the frozen ``AutoencoderKLWan``, as Wan's ``video``), with the latents of
  the reference images (encoded together, as one clip) before them in time when there are any;
- ``vace_context``: the latents of the control video where the mask is 0 (``inactive``) and where it is 1
  (``reactive``), on channels, then the mask's 8 x 8 pixel patches as 64 channels, nearest-exact resized in time
  to the latent frames (``(T + 3) // 4``); 2 x 16 + 64 = 96 channels for Wan. Without a control video it is black
  frames, without a mask all ones; reference images add their latents (and zeros) and a zero mask before in time;
- ``prompt_ids`` / ``prompt_mask``: the text encoder's features, as Wan's.

Frames as ``VACEVideoProcessor`` picks them (:func:`vace_target`): the target size and frame count follow from the
first clip's size, frame rate and duration (``max_hxw``, ``train_fps``, ``vae_stride`` x ``vae_patch_size``), the
frames are those at evenly spaced time stamps, and every clip of the record is resized to fill that size (its
``ResizeCropVideo``: resized on the ``uint8`` frames, centre-cropped), scaled to [0, 1] and normalised. The mask is
the first channel of its clip so processed, brought back to [0, 1]. Reference images are ``ResizeToFill``-ed (fitted
inside a white canvas of the target size) after normalisation.
"""

from __future__ import annotations

import hashlib
import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lightning_mm.errors import ConfigError, DataError

__all__ = [
    "MASK_PATCH",
    "ClipTiming",
    "VacePixels",
    "caption_file_name",
    "basic_clean",
    "clip_timing",
    "vace_target",
    "read_clip_frames",
    "resize_crop_to_fill",
    "resize_to_fill",
    "mask_latents",
    "vace_context",
    "VacePipeline",
    "process_clip",
    "process_reference",
    "record_pixels",
]

MASK_PATCH = 8
"""The mask's pixel patch side in ``get_vace_feature.py`` (``P=8, Q=8``): the Wan VAE's spatial factor."""

MAX_SIDE = 8192
"""The largest width or height of a source clip (8K, as the raw-video path's ``MAX_SOURCE_SIDE``)."""

MAX_HXW = (480 * 832, 720 * 1280)
"""The ``max_hxw`` values ``VACEVideoProcessor`` accepts (others are its ``NotImplementedError``)."""


def caption_file_name(caption: str) -> str:
    """MindSpeed MM's VACE feature file name: the MD5 of the caption (UTF-8), hex, ``.pt``."""
    return hashlib.md5(caption.encode("UTF-8")).hexdigest() + ".pt"


def basic_clean(text: str) -> str:
    """MindSpeed MM's ``basic_clean``: ``ftfy.fix_text``, HTML entities unescaped twice, stripped (needs ``ftfy``)."""
    import importlib

    ftfy = importlib.import_module("ftfy")  # PyPI `ftfy`, imported only for this text preprocessing method
    return html.unescape(html.unescape(ftfy.fix_text(text))).strip()


@dataclass
class ClipTiming:
    """What ``VACEVideoProcessor`` reads of a clip before decoding: its frame rate, frame count, each frame's
    ``(start, end)`` time stamps in seconds (``float32``, as decord's ``get_frame_timestamp``) and frame size."""

    fps: float
    timestamps: np.ndarray
    height: int
    width: int

    @property
    def length(self) -> int:
        return int(self.timestamps.shape[0])


def clip_timing(path: Path) -> ClipTiming:
    """The :class:`ClipTiming` of the video at ``path`` (PyAV: packets demuxed, not decoded; time stamps in
    presentation order from the stream's start, each frame ending where the next starts, the last after its
    packet's duration)."""
    import av  # PyPI `av`, the `diffusers` extra

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise DataError(f"{path}: no video stream")
            stream = container.streams.video[0]
            base = float(stream.time_base) if stream.time_base is not None else 0.0
            rate = stream.average_rate
            fps = float(rate) if rate else 0.0
            first = stream.start_time or 0
            packets = sorted(
                (int(p.pts) - first, int(p.duration or 0))
                for p in container.demux(stream)
                if p.size and p.pts is not None
            )
            height, width = stream.codec_context.height, stream.codec_context.width
    except av.error.FFmpegError as err:
        raise DataError(f"{path}: not a readable video ({err})") from err
    if not packets or fps <= 0 or base <= 0:
        raise DataError(f"{path}: no frames with time stamps and a frame rate")
    if min(height, width) < 1 or max(height, width) > MAX_SIDE:
        raise DataError(f"{path}: {width}x{height} frames; the largest source side is {MAX_SIDE} pixels")
    starts = [pts * base for pts, _ in packets]
    ends = [*starts[1:], starts[-1] + (packets[-1][1] * base or 1.0 / fps)]
    return ClipTiming(fps, np.array(list(zip(starts, ends)), dtype=np.float32), height, width)


def vace_target(
    timing: ClipTiming,
    length: int,
    max_hxw: int,
    num_frames: int,
    train_fps: float,
    downsample: tuple[int, int, int],
    keep_last: bool,
) -> tuple[list[int], tuple[int, int]]:
    """``VACEVideoProcessor._get_frameid_bbox_default`` (``keep_last: false``) or ``_adjust_last``: the frame
    indices to read and the target ``(height, width)``, from the first clip's timing (``length``: the shortest
    clip's frame count). A clip too short for one latent frame is a :class:`DataError`."""
    stamps = timing.timestamps[:length]
    seq_len = (max_hxw / (downsample[1] * downsample[2])) * (1 + (num_frames - 1) / 4)
    h, w = timing.height, timing.width
    ratio = h / w
    down_t, down_h, down_w = downsample
    duration = stamps[-1].mean()
    area_z = min(seq_len, max_hxw / (down_h * down_w), (h // down_h) * (w // down_w))
    if area_z <= 0:
        raise DataError(f"{h}x{w} frames: smaller than one latent patch ({down_h}x{down_w})")
    target_fps = min(timing.fps, train_fps)
    frames_from_time = (length - 1) if keep_last else int(duration * target_fps) - 1
    target_frame = min(frames_from_time // down_t + 1, int(seq_len / area_z))
    if target_frame < 1:
        raise DataError(f"{length} frame(s) ({float(duration):.3f} s): too short for one latent frame")
    target_area_z = min(area_z, int(seq_len / target_frame))
    target_height = round(np.sqrt(target_area_z * ratio))
    if target_height < 1:
        raise DataError(f"{h}x{w} frames: too wide for the latent area")
    target_width = int(target_area_z / target_height)
    target_frame = (target_frame - 1) * down_t + 1
    if keep_last:
        timestamps = np.linspace(0.0, duration, target_frame)
        hits = np.logical_and(timestamps[:, None] >= stamps[None, :, 0], timestamps[:, None] <= stamps[None, :, 1])
    else:
        timestamps = np.linspace(0.0, target_frame / target_fps, target_frame)
        hits = np.logical_and(timestamps[:, None] >= stamps[None, :, 0], timestamps[:, None] < stamps[None, :, 1])
    ids = np.argmax(hits, axis=1).tolist()
    return [int(i) for i in ids], (int(target_height) * down_h, int(target_width) * down_w)


def read_clip_frames(path: Path, ids: Sequence[int]) -> torch.Tensor:
    """Frames ``ids`` (presentation order) of the video at ``path``, ``uint8 (T, C, H, W)``; only the frames
    named are kept."""
    import av  # PyPI `av`, the `diffusers` extra

    wanted = set(ids)
    last = max(ids)
    kept: dict[int, torch.Tensor] = {}
    try:
        with av.open(str(path)) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index > last:
                    break
                if index in wanted:
                    kept[index] = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
    except av.error.FFmpegError as err:
        raise DataError(f"{path}: not a readable video ({err})") from err
    missing = sorted(wanted - set(kept))
    if missing:
        raise DataError(f"{path}: frame(s) {missing[:5]} do not decode")
    return torch.stack([kept[i] for i in ids])


def resize_crop_to_fill(
    clip: torch.Tensor, size: tuple[int, int], mode: str, antialias: bool, align_corners: bool = False
) -> torch.Tensor:
    """MindSpeed MM's ``resize_crop_to_fill`` (``ResizeCropVideo``): resized so that ``size`` is covered (the
    side with the larger scale fits), then cropped at the centre of the other side. ``clip``: ``(T, C, H, W)``."""
    h, w = clip.shape[-2:]
    th, tw = size
    rh, rw = th / h, tw / w
    if rh > rw:
        sh, sw = th, round(w * rh)
        i, j = 0, int(round(sw - tw) / 2.0)
    else:
        sh, sw = round(h * rw), tw
        i, j = int(round(sh - th) / 2.0), 0
    clip = F.interpolate(clip, size=(sh, sw), mode=mode, align_corners=align_corners, antialias=antialias)
    return clip[..., i : i + th, j : j + tw]


def resize_to_fill(
    image: torch.Tensor, size: tuple[int, int], mode: str, antialias: bool, align_corners: bool = False
) -> torch.Tensor:
    """MindSpeed MM's ``ResizeToFill``: an image ``(1, 3, H, W)`` not of ``size`` is resized by the smaller scale
    and pasted at the centre of a white (ones) canvas of ``size``."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    ch, cw = size
    h, w = image.shape[-2:]
    scale = min(ch / h, cw / w)
    nh, nw = int(h * scale), int(w * scale)
    resized = F.interpolate(image, size=(nh, nw), mode=mode, align_corners=align_corners, antialias=antialias)
    canvas = torch.ones((1, 3, ch, cw))
    top, left = (ch - nh) // 2, (cw - nw) // 2
    canvas[:, :, top : top + nh, left : left + nw] = resized
    return canvas


def mask_latents(mask: torch.Tensor) -> torch.Tensor:
    """``get_vace_feature.py``'s mask latents: ``(T, H, W)`` -> ``(64, (T + 3) // 4, H / 8, W / 8)``: each 8 x 8
    patch's pixels on channels (row-major within the patch), nearest-exact resized in time."""
    t, h, w = mask.shape
    p = MASK_PATCH
    patches = mask.view(t, h // p, p, w // p, p).permute(2, 4, 0, 1, 3).reshape(1, p * p, t, h // p, w // p)
    resized = F.interpolate(patches, size=((t + 3) // 4, h // p, w // p), mode="nearest-exact")
    return resized[0]


@dataclass
class VacePixels:
    """One record's model inputs: the target ``video`` ``(3, T, H, W)`` in [-1, 1], the control video
    ``src_video`` (same shape) or ``None``, the ``mask`` ``(1, T, H, W)`` in [0, 1] or ``None``, and the reference
    images ``(3, 1, H, W)``."""

    video: torch.Tensor
    src_video: torch.Tensor | None
    mask: torch.Tensor | None
    refs: list[torch.Tensor]


def vace_context(encode: Any, pixels: VacePixels) -> dict[str, torch.Tensor]:
    """``VACEFeatureExtractor._extract_single``'s ``video`` and ``vace_context``; ``encode`` maps a ``(3, T, H, W)``
    clip to its normalised latents ``(C, F, H', W')``."""
    video = pixels.video
    latents = encode(video)
    ref_latents = encode(torch.cat(pixels.refs, dim=1)) if pixels.refs else None
    if ref_latents is not None:
        latents = torch.cat([ref_latents, latents], dim=1)
    src = pixels.src_video if pixels.src_video is not None else torch.zeros_like(video)
    mask = pixels.mask if pixels.mask is not None else torch.ones_like(src)
    inactive = encode(src * (1 - mask) + 0 * mask)
    reactive = encode(src * mask + 0 * (1 - mask))
    context = torch.cat([inactive, reactive], dim=0)
    mask_lat = mask_latents(mask[0])
    if mask_lat.shape[1:] != context.shape[1:]:
        raise ConfigError(
            f"the mask's latent grid {tuple(mask_lat.shape[1:])} is not the VAE's {tuple(context.shape[1:])}: "
            "VACE needs the VAE's 4x temporal and 8x spatial factors"
        )
    if ref_latents is not None:
        context = torch.cat([torch.cat([ref_latents, torch.zeros_like(ref_latents)], dim=0), context], dim=1)
        mask_lat = torch.cat([torch.zeros_like(mask_lat[:, : ref_latents.shape[1]]), mask_lat], dim=1)
    return {"video": latents, "vace_context": torch.cat([context, mask_lat], dim=0)}


@dataclass
class VacePipeline:
    """The ``train_pipeline`` of a VACE data config: the video's ``ResizeCropVideo`` (on ``uint8`` frames), then
    ``ToTensorVideo`` and ``norm_fun``; the reference image's ``ToTensorVideo``, ``norm_fun``, then
    ``ResizeToFill``."""

    video_mode: str = "bicubic"
    video_antialias: bool = True
    video_align_corners: bool = False
    video_mean: tuple[float, ...] = (0.5,)
    video_std: tuple[float, ...] = (0.5,)
    image_mode: str = "bilinear"
    image_antialias: bool = False
    image_align_corners: bool = False
    image_mean: tuple[float, ...] = (0.5,)
    image_std: tuple[float, ...] = (0.5,)


def _normalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """torchvision's ``Normalize`` on ``(..., C, H, W)``."""
    m = torch.tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(-1, 1, 1)
    return (x - m) / s


def process_clip(frames: torch.Tensor, width: int, size: tuple[int, int], pipe: VacePipeline) -> torch.Tensor:
    """``uint8 (T, C, H, W)`` -> ``(C, T, h, w)``: ``VACEVideoProcessor``'s crop ``[:, y1:y2, x1:x2, :]`` on the
    ``(T, C, H, W)`` frames (which, as upstream, keeps the first ``width`` rows of a clip taller than wide), the
    resize-crop to ``size``, ``/ 255`` and the normalisation."""
    frames = frames[:, :, :width]
    clip = resize_crop_to_fill(frames, size, pipe.video_mode, pipe.video_antialias, pipe.video_align_corners)
    clip = _normalize(clip.float() / 255.0, pipe.video_mean, pipe.video_std)
    return clip.permute(1, 0, 2, 3).contiguous()


def process_reference(path: Path, size: tuple[int, int], pipe: VacePipeline) -> torch.Tensor:
    """A reference image file -> ``(3, 1, h, w)``: read as RGB (PIL), ``/ 255``, normalised, ``ResizeToFill``."""
    from PIL import Image

    try:
        with Image.open(path) as opened:
            array = np.array(opened.convert("RGB"))
    except OSError as err:
        raise DataError(f"{path}: not a readable image ({err})") from None
    image = torch.from_numpy(array).permute(2, 0, 1)[None]
    image = _normalize(image.float() / 255.0, pipe.image_mean, pipe.image_std)
    image = resize_to_fill(image, size, pipe.image_mode, pipe.image_antialias, pipe.image_align_corners)
    return image.permute(1, 0, 2, 3).contiguous()


def record_pixels(
    video: Path,
    src_video: Path | None,
    mask: Path | None,
    refs: Sequence[Path],
    ids: Sequence[int],
    size: tuple[int, int],
    width: int,
    pipe: VacePipeline,
) -> VacePixels:
    """``VACEDataset.__getitem__``: the clips of one record read at ``ids`` and processed to ``size``; the mask is
    its processed clip's first channel, ``clamp((m + 1) / 2, 0, 1)``; ``width`` is the first clip's frame width."""
    target = process_clip(read_clip_frames(video, ids), width, size, pipe)
    src = process_clip(read_clip_frames(src_video, ids), width, size, pipe) if src_video is not None else None
    processed_mask = None
    if mask is not None:
        processed_mask = process_clip(read_clip_frames(mask, ids), width, size, pipe)
        processed_mask = torch.clamp((processed_mask[:1] + 1) / 2, min=0, max=1)
    return VacePixels(target, src, processed_mask, [process_reference(p, size, pipe) for p in refs])
