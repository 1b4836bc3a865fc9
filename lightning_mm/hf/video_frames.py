"""A video file's frames, decoded with PyAV and sampled as MindSpeed MM's Qwen-VL plugins sample them.

MindSpeed MM (``mindspeed_mm/fsdp/data/data_utils/func_utils/mm_plugin.py``, commit 57069cd5):

- ``MMPluginMixin._get_video_sample_indices``: ``floor(duration_seconds * video_fps)`` frames (at least one), at
  most the stream's frame count and ``video_maxlen``, spread evenly over the stream
  (``np.linspace(0, frames - 1, n).astype(np.int32)``); a stream that reports no frame count takes its first
  ``video_maxlen`` frames;
- ``Qwen2VLPlugin._regularize_videos``: the frames at those indices, decoded in order; the video's sampling rate
  ``len(indices) / duration_seconds`` (``video_fps`` when the stream has no duration); an odd frame count gets
  its last frame once more (the temporal patch takes frames in pairs).

Transformers' video loaders are not used: they need torchvision or torchcodec, which the CPU build cannot load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mm.errors import DataError

__all__ = ["DecodedVideo", "VideoError", "sample_indices", "probe_video", "sampled_frames", "decode_video"]


class VideoError(DataError):
    """A video file that cannot be decoded or sampled."""


@dataclass
class DecodedVideo:
    frames: list[Any]
    """The sampled frames as RGB PIL images, in order (the last one repeated once when their count was odd)."""
    fps: float
    """The sampling rate: sampled frames per second of the stream (MindSpeed MM's ``fps_per_video``)."""


def sample_indices(total_frames: int, duration_s: float | None, video_fps: float, video_maxlen: int) -> list[int]:
    """``_get_video_sample_indices``: which frames of a stream of ``total_frames`` frames lasting ``duration_s``
    seconds are kept."""
    import numpy as np

    if total_frames == 0:  # a stream that does not say how many frames it has
        return [int(i) for i in np.linspace(0, video_maxlen - 1, video_maxlen).astype(np.int32)]
    if duration_s is None:
        raise VideoError("the video stream reports no duration, so frames cannot be sampled by video_fps")
    count = max(1, math.floor(duration_s * video_fps))
    count = min(total_frames, video_maxlen, count)
    return [int(i) for i in np.linspace(0, total_frames - 1, count).astype(np.int32)]


def probe_video(path: str | Path) -> None:
    """Check that ``path`` opens as a media container with a video stream (no frame is decoded)."""
    import av

    try:
        with av.open(str(path), "r") as container:
            if not any(s.type == "video" for s in container.streams):
                raise VideoError(f"{path}: no video stream")
    except VideoError:
        raise
    except Exception as err:  # PyAV raises its own error types for broken files
        raise VideoError(f"{path}: cannot open the video: {str(err)[:200]}") from None


def _duration(stream: Any) -> float | None:
    return None if stream.duration is None else float(stream.duration * stream.time_base)


def sampled_frames(path: str | Path, video_fps: float, video_maxlen: int, even: bool = True) -> tuple[int, int, int]:
    """How many frames :func:`decode_video` gives for ``path`` and their ``(width, height)``, from the container's
    metadata (the stream's frame count, duration and coded size), no frame decoded. :class:`VideoError` where the
    stream does not report its frame count (then only decoding says how many frames it has)."""
    import av

    try:
        with av.open(str(path), "r") as container:
            streams = [s for s in container.streams if s.type == "video"]
            if not streams:
                raise VideoError(f"{path}: no video stream")
            stream = streams[0]
            total, width, height = int(stream.frames or 0), int(stream.width or 0), int(stream.height or 0)
            duration = _duration(stream)
    except VideoError:
        raise
    except Exception as err:  # PyAV raises its own error types for broken files
        raise VideoError(f"{path}: cannot open the video: {str(err)[:200]}") from None
    if total <= 0 or width <= 0 or height <= 0:
        raise VideoError(f"{path}: the video stream reports no frame count or size")
    count = len(sample_indices(total, duration, video_fps, video_maxlen))
    return count + (count % 2 if even else 0), width, height


def decode_video(path: str | Path, video_fps: float, video_maxlen: int, even: bool = True) -> DecodedVideo:
    """The sampled frames of the first video stream of ``path`` and its sampling rate (see the module's notes)."""
    import av

    try:
        with av.open(str(path), "r") as container:
            streams = [s for s in container.streams if s.type == "video"]
            if not streams:
                raise VideoError(f"{path}: no video stream")
            stream = streams[0]
            duration = _duration(stream)
            indices = sample_indices(int(stream.frames or 0), duration, video_fps, video_maxlen)
            wanted = set(indices)
            last = max(indices)
            frames = []
            container.seek(0)
            for index, frame in enumerate(container.decode(stream)):
                if index in wanted:
                    frames.append(frame.to_image())
                if index >= last:
                    break
    except VideoError:
        raise
    except Exception as err:  # PyAV raises its own error types for broken files
        raise VideoError(f"{path}: cannot decode the video: {str(err)[:200]}") from None
    if not frames:
        raise VideoError(f"{path}: no frame decoded")
    fps = video_fps if duration is None else len(indices) / duration
    if even and len(frames) % 2:
        frames.append(frames[-1])
    return DecodedVideo(frames, fps)
