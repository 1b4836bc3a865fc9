"""The Qwen-VL families' video processing (Transformers' ``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``),
without torchvision.

Transformers 5's video processors import torchvision, which the CPU build of torch cannot load. What they compute
on a list of frames is plain tensor work, done here step by step as ``_preprocess`` does it (Transformers 5.24,
``models/qwen2_vl/video_processing_qwen2_vl.py``, ``models/qwen3_vl/video_processing_qwen3_vl.py``):

1. Qwen3-VL only (``do_sample_frames``): ``sample_frames`` picks ``int(frames / metadata_fps * fps)`` frames
   (within ``min_frames``, ``max_frames`` and the frame count) by ``np.linspace(...).round()``;
2. the frames as a ``uint8`` tensor ``(T, C, H, W)``;
3. ``resize``: ``smart_resize`` (Qwen2-VL's per frame; Qwen3-VL's counts the frames) to multiples of
   ``patch_size * merge_size`` within ``size``, then torchvision's ``resize`` of a ``uint8`` tensor on the CPU with
   bicubic interpolation and antialiasing, which is ``torch.nn.functional.interpolate`` on the ``uint8`` tensor
   (torchvision's native ``uint8`` path; an unchanged size is no resize);
4. the fused rescale and normalise (``(x - mean / rescale) / (std / rescale)`` in float32);
5. ``patchify``: the frames padded to a multiple of ``temporal_patch_size`` with the last one, and laid out as
   ``(grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2)`` in merge-window order.

The settings are read as Transformers reads them: ``processor_config.json``'s ``video_processor``, else
``video_preprocessor_config.json``, else ``preprocessor_config.json``, over the class's defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_mm.errors import ConfigError, DataError

__all__ = ["VIDEO_FAMILIES", "QwenVideoSettings", "QwenVideoProcessor", "load_video_settings"]

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3
VIDEO_FAMILIES = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen2_5_omni": "qwen2_vl",
    "qwen2_5_omni_thinker": "qwen2_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_5": "qwen3_vl",
    "qwen3_5_moe": "qwen3_vl",
}
"""``model_type`` -> the video processor it loads in Transformers (``video_processing_auto.py``)."""


@dataclass(frozen=True)
class QwenVideoSettings:
    """The video processor's settings (its class defaults, then its saved configuration)."""

    kind: str
    """``qwen2_vl`` (``Qwen2VLVideoProcessor``) or ``qwen3_vl`` (``Qwen3VLVideoProcessor``)."""
    shortest_edge: int
    longest_edge: int
    patch_size: int
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


_DEFAULTS = {
    "qwen2_vl": QwenVideoSettings("qwen2_vl", 128 * 28 * 28, 28 * 28 * 768, 14),
    "qwen3_vl": QwenVideoSettings(
        "qwen3_vl",
        128 * 32 * 32,
        32 * 32 * 768,
        16,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        do_sample_frames=True,
        fps=2,
        max_video_tokens=768,
    ),
}
_INTS = ("patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames", "max_video_tokens")
_FLAGS = ("do_resize", "do_rescale", "do_normalize", "do_sample_frames", "cap_pixels_per_frame")


def _saved_settings(model_dir: Path) -> tuple[dict[str, Any], str]:
    nested = model_dir / "processor_config.json"
    if nested.is_file():
        data = json.loads(nested.read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("video_processor"), dict):
            return data["video_processor"], str(nested)
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        file = model_dir / name
        if file.is_file():
            data = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ConfigError(f"{file}: expected a JSON object")
            return data, str(file)
    return {}, "the class defaults"


def load_video_settings(model_dir: str | Path, model_type: str) -> QwenVideoSettings:
    """The settings of the video processor Transformers would load for ``model_type`` from ``model_dir``."""
    kind = VIDEO_FAMILIES.get(model_type)
    if kind is None:
        raise ConfigError(f"no Qwen-VL video processor for model_type {model_type!r}")
    data, source = _saved_settings(Path(model_dir))
    settings = _DEFAULTS[kind]
    changes: dict[str, Any] = {}
    size = data.get("size")
    if isinstance(size, dict):
        if size.get("shortest_edge") is not None:
            changes["shortest_edge"] = int(size["shortest_edge"])
        if size.get("longest_edge") is not None:
            changes["longest_edge"] = int(size["longest_edge"])
    if kind == "qwen2_vl":  # Qwen2VLVideoProcessor.__init__: min_pixels / max_pixels win over size
        if data.get("min_pixels") is not None:
            changes["shortest_edge"] = int(data["min_pixels"])
        if data.get("max_pixels") is not None:
            changes["longest_edge"] = int(data["max_pixels"])
    for key in _INTS:
        if data.get(key) is not None:
            changes[key] = int(data[key])
    for key in _FLAGS:
        if data.get(key) is not None:
            changes[key] = bool(data[key])
    for key in ("image_mean", "image_std"):
        if data.get(key) is not None:
            value = data[key]
            changes[key] = tuple(float(v) for v in (value if isinstance(value, list) else [value] * 3))
    if data.get("rescale_factor") is not None:
        changes["rescale_factor"] = float(data["rescale_factor"])
    for key in ("fps", "num_frames"):
        if key in data:
            changes[key] = data[key]
    resample = data.get("resample", _BICUBIC)
    if resample != _BICUBIC:
        raise ConfigError(f"{source}: video resample {resample!r} is not supported here (only bicubic, 3)")
    if kind == "qwen2_vl" and changes.get("do_sample_frames"):
        raise ConfigError(f"{source}: do_sample_frames is not supported here for Qwen2-VL's video processor")
    if data.get("do_center_crop"):
        raise ConfigError(f"{source}: do_center_crop is not supported here for videos")
    return replace(settings, **changes)


# ----------------------------------------------------------------------------------------------- the steps
def smart_resize_qwen2(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: multiples of ``factor`` near the aspect ratio, within the pixel bounds."""
    if max(height, width) / min(height, width) > 200:
        raise DataError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_qwen3(
    frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: the bounds count all frames (rounded to the temporal patch)."""
    if frames < temporal:
        raise DataError(f"t:{frames} must be larger than temporal_factor:{temporal}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise DataError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class QwenVideoProcessor:
    """``processor(frames_per_video, metadata_fps)`` -> ``pixel_values_videos``, ``video_grid_thw`` and the frame
    indices each video kept (``frames_indices``, for Qwen3-VL's timestamps)."""

    def __init__(self, settings: QwenVideoSettings) -> None:
        self.settings = settings

    @property
    def merge_size(self) -> int:
        return self.settings.merge_size

    def sample_frames(self, total: int, metadata_fps: float | None) -> list[int]:
        """``Qwen3VLVideoProcessor.sample_frames`` (with ``fps`` or ``num_frames`` of the settings)."""
        import numpy as np

        s = self.settings
        num_frames = s.num_frames
        if num_frames is None and s.fps is not None:
            fps = 24 if metadata_fps is None else metadata_fps
            num_frames = int(total / fps * s.fps)
            num_frames = min(max(num_frames, s.min_frames), s.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, s.min_frames), s.max_frames)
        return [int(i) for i in np.linspace(0, total - 1, num_frames).round().astype(int)]

    def kept_frames(self, total: int, metadata_fps: float | None) -> list[int]:
        """The indices of the frames of a ``total``-frame video that the processor keeps (all of them unless
        ``do_sample_frames``)."""
        return self.sample_frames(total, metadata_fps) if self.settings.do_sample_frames else list(range(total))

    def resized_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` that ``resize`` gives ``frames`` frames of ``height`` x ``width`` (``smart_resize``
        with the settings' bounds; the size itself where ``do_resize`` is off)."""
        s = self.settings
        if not s.do_resize:
            return height, width
        factor = s.patch_size * s.merge_size
        max_pixels = s.longest_edge
        if s.kind == "qwen2_vl":
            if s.cap_pixels_per_frame:
                total = int(s.max_video_tokens * factor * factor * 0.9)
                max_pixels = max(min(max_pixels, total * s.temporal_patch_size // frames), int(s.shortest_edge * 1.05))
            return smart_resize_qwen2(height, width, factor, s.shortest_edge, max_pixels)
        if s.cap_pixels_per_frame:
            per_frame = max(
                min(s.max_video_tokens * factor * factor, s.longest_edge // frames), int(s.shortest_edge * 1.05)
            )
            max_pixels = per_frame * frames
        return smart_resize_qwen3(frames, height, width, s.temporal_patch_size, factor, s.shortest_edge, max_pixels)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``video_grid_thw`` of ``frames`` frames of ``height`` x ``width`` as they are sampled (``sample_frames``
        done): ``resize`` then ``patchify`` (the frames padded to the temporal patch)."""
        s = self.settings
        height, width = self.resized_size(frames, height, width)
        if height % (s.patch_size * s.merge_size) or width % (s.patch_size * s.merge_size):
            raise DataError(f"frames of {height}x{width} do not split into merged patches of {s.patch_size}")
        return -(-frames // s.temporal_patch_size), height // s.patch_size, width // s.patch_size

    def _resize(self, video: Any) -> Any:
        import torch.nn.functional as F

        frames, _, height, width = video.shape
        new = self.resized_size(frames, height, width)
        if new == (height, width):
            return video
        return F.interpolate(video, size=list(new), mode="bicubic", align_corners=False, antialias=True)

    def _normalize(self, video: Any) -> Any:
        import torch

        s = self.settings
        if s.do_rescale and s.do_normalize:
            mean = torch.tensor(s.image_mean) * (1.0 / s.rescale_factor)
            std = torch.tensor(s.image_std) * (1.0 / s.rescale_factor)
        elif s.do_normalize:
            mean, std = torch.tensor(s.image_mean), torch.tensor(s.image_std)
        elif s.do_rescale:
            return video * s.rescale_factor
        else:
            return video
        video = video.to(torch.float32)
        mean = mean.to(torch.float32).view(-1, 1, 1)
        std = std.to(torch.float32).view(-1, 1, 1)
        return (video - mean).div_(std)

    def _patchify(self, video: Any) -> tuple[Any, list[int]]:
        import torch

        s = self.settings
        frames, channels, height, width = video.shape
        if pad := -frames % s.temporal_patch_size:
            video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)), dim=0)
            frames += pad
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        grid = [frames // t, height // p, width // p]
        patches = video.reshape(grid[0], t, channels, grid[1] // m, m, p, grid[2] // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(grid[0] * grid[1] * grid[2], channels * t * p * p), grid

    def __call__(self, videos: list[list[Any]], metadata_fps: float | None = None) -> dict[str, Any]:
        import numpy as np
        import torch

        pixels, grids, kept = [], [], []
        for frames in videos:
            indices = self.kept_frames(len(frames), metadata_fps)
            array = np.stack([np.asarray(frames[i].convert("RGB")) for i in indices])
            video = self._resize(torch.from_numpy(array).permute(0, 3, 1, 2).contiguous())
            patches, grid = self._patchify(self._normalize(video))
            pixels.append(patches)
            grids.append(grid)
            kept.append(indices)
        return {
            "pixel_values_videos": torch.cat(pixels, dim=0),
            "video_grid_thw": torch.tensor(grids, dtype=torch.long),
            "frames_indices": kept,
        }
