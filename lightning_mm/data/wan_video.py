"""Raw videos for the Wan recipes: decode a clip, bring it to the config's frame count and resolution, and encode it
with a frozen ``AutoencoderKLWan`` into the latents the transformer trains on.

The steps follow MindSpeed MM's Wan video pipeline (``preprocess_parameters`` of its ``data.json``): frames
``0, frame_interval, 2 * frame_interval, ...`` (``num_frames`` of them; a shorter clip is an error), resized with
bilinear, antialiased interpolation so that the short side fits ``max_height`` x ``max_width`` (the ``shortside``
mode of its ``ResizeVideo``), centre-cropped to ``max_height`` x ``max_width``, scaled to ``[0, 1]`` and normalised
with mean 0.5 and std 0.5 to ``[-1, 1]``. The VAE (``diffusers.AutoencoderKLWan.from_pretrained(vae_path)``, in
eval mode, no gradients, not part of the trained model) gives the mode of its latent distribution, normalised with
its config's ``latents_mean`` / ``latents_std`` as MindSpeed MM's ``DiffusersAEModel`` does; MindSpeed MM's
``do_sample`` (drawing from the distribution) is not done here. Videos are decoded with PyAV (the ``av`` package,
extra ``diffusers``).

Bounded work per record: when the dataset is set up, each video is probed (:func:`probe_video`: its container is
opened, its packets counted without decoding them, its first frame decoded), and a clip that is empty, does not
decode, has fewer frames than ``num_frames`` at ``frame_interval`` needs, or whose frames are larger than
:data:`MAX_SOURCE_SIDE` on a side is a bad record (counted with its ``file:line``, skipped; an error in strict mode).
Decoding (:func:`decode_model_frames`) then resizes each frame as it is decoded, one frame at a time and in bands
of rows: memory grows with the output (``num_frames`` x ``max_height`` x ``max_width``) and one source frame's
``uint8`` pixels, never with the clip's frames at full resolution in floating point. The result is the same, bit for
bit, as resizing the whole clip at once (the interpolation is separable: rows first, then columns).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_mm.data.record_files import DataError

__all__ = ["MAX_SOURCE_SIDE", "read_frames", "probe_video", "decode_model_frames", "to_model_frames", "FrozenWanVAE"]

MAX_SOURCE_SIDE = 8192
"""The largest width or height of a source video's frames (8K); a larger clip is a bad record."""

_BAND = 64
"""Rows of a source frame converted to floating point at a time (the width resize runs band by band)."""


def _wanted(num_frames: int, frame_interval: int) -> int:
    """How many frames from the start a clip needs for ``num_frames`` at ``frame_interval``."""
    return num_frames * frame_interval - (frame_interval - 1)


def _too_large(width: int, height: int) -> str | None:
    if width <= 0 or height <= 0:
        return f"no frame size ({width}x{height})"
    if max(width, height) > MAX_SOURCE_SIDE:
        return f"{width}x{height} frames; the largest source side is {MAX_SOURCE_SIDE} pixels (MAX_SOURCE_SIDE)"
    return None


def probe_video(path: str | Path, num_frames: int, frame_interval: int = 1) -> str | None:
    """Why the video at ``path`` cannot give ``num_frames`` frames at ``frame_interval`` (``None``: it can, as far
    as its container and first frame tell): no video stream, frames larger than :data:`MAX_SOURCE_SIDE`, fewer
    packets than frames needed, a first frame that does not decode, or a file PyAV cannot open. Packets are counted
    by demuxing (no decoding) and the count stops once it is enough."""
    import av  # PyPI `av`, the `diffusers` extra

    wanted = _wanted(num_frames, frame_interval)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return "no video stream"
            stream = container.streams.video[0]
            too_large = _too_large(stream.codec_context.width, stream.codec_context.height)
            if too_large is not None:
                return too_large
            packets, decoded = 0, False
            for packet in container.demux(stream):
                if packet.size:
                    packets += 1
                if not decoded:
                    decoded = any(True for _ in packet.decode())  # the flush packet (size 0) drains the decoder
                if decoded and packets >= wanted:
                    break
    except Exception as err:  # whatever PyAV raises for one file is that record's problem
        return f"not a readable video ({type(err).__name__}: {str(err)[:160]})"
    if not decoded:
        return "no frame decodes"
    if packets < wanted:
        return f"{packets} frame(s), num_frames {num_frames} at frame_interval {frame_interval} needs {wanted}"
    return None


def read_frames(path: str | Path, num_frames: int, frame_interval: int = 1) -> torch.Tensor:
    """Frames ``0, frame_interval, ...`` (``num_frames`` of them) of the video at ``path``, ``uint8 (T, H, W, 3)``."""
    import av  # PyPI `av`, the `diffusers` extra

    wanted = num_frames * frame_interval - (frame_interval - 1)
    frames = []
    try:
        with av.open(str(path)) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index >= wanted:
                    break
                if index % frame_interval == 0:
                    frames.append(torch.from_numpy(frame.to_ndarray(format="rgb24")))
    except av.error.FFmpegError as err:
        raise DataError(f"{path}: not a readable video ({err})") from err
    if len(frames) < num_frames:
        raise DataError(f"{path}: {len(frames)} frame(s) at interval {frame_interval}, num_frames is {num_frames}")
    return torch.stack(frames)


def decode_model_frames(
    path: str | Path, num_frames: int, frame_interval: int, height: int, width: int
) -> torch.Tensor:
    """:func:`read_frames` and :func:`to_model_frames` in one pass: each frame resized as it is decoded (see the
    module docstring), ``float32 (3, T, height, width)`` in ``[-1, 1]``."""
    import av  # PyPI `av`, the `diffusers` extra

    wanted = _wanted(num_frames, frame_interval)
    frames = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise DataError(f"{path}: no video stream")
            stream = container.streams.video[0]
            too_large = _too_large(stream.codec_context.width, stream.codec_context.height)
            if too_large is not None:
                raise DataError(f"{path}: {too_large}")
            for index, frame in enumerate(container.decode(stream)):
                if index >= wanted:
                    break
                if index % frame_interval == 0:
                    pixels = torch.from_numpy(frame.to_ndarray(format="rgb24"))
                    frames.append(_model_frame(pixels, height, width))
    except av.error.FFmpegError as err:
        raise DataError(f"{path}: not a readable video ({err})") from err
    if len(frames) < num_frames:
        raise DataError(f"{path}: {len(frames)} frame(s) at interval {frame_interval}, num_frames is {num_frames}")
    return torch.stack(frames, dim=1)


def _model_frame(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``uint8 (H, W, 3)`` -> ``float32 (3, height, width)`` in ``[-1, 1]``: short-side resize (bilinear,
    antialiased), centre crop. The width is resized band by band of rows, then the height: what resizing the whole
    frame gives, bit for bit, without the frame in floating point at full resolution."""
    h, w = pixels.shape[:2]
    scale = max(height / h, width / w)
    size = (max(height, round(h * scale)), max(width, round(w * scale)))
    image = pixels.permute(2, 0, 1)[None]  # (1, 3, H, W), a view
    if size[1] != w:
        bands = [
            F.interpolate(
                image[..., top : top + _BAND, :].float(),
                size=(min(_BAND, h - top), size[1]),
                mode="bilinear",
                antialias=True,
                align_corners=False,
            )
            for top in range(0, h, _BAND)
        ]
        video = torch.cat(bands, dim=-2)
    else:
        video = image.float()
    if size[0] != h:
        video = F.interpolate(video, size=size, mode="bilinear", antialias=True, align_corners=False)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    video = video[0, :, top : top + height, left : left + width]
    return ((video / 255.0 - 0.5) / 0.5).contiguous()


def to_model_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``uint8 (T, H, W, 3)`` -> ``float32 (3, T, height, width)`` in ``[-1, 1]``: short-side resize, centre crop,
    frame by frame (as :func:`decode_model_frames`)."""
    return torch.stack([_model_frame(frame, height, width) for frame in frames], dim=1)


class FrozenWanVAE:
    """``AutoencoderKLWan`` from a ``save_pretrained`` directory, loaded on first use in each process."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise DataError(f"{self.path}: not a save_pretrained directory of AutoencoderKLWan (no config.json)")
        self._vae: Any = None

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers load their own copy
        return {"path": self.path, "_vae": None}

    @property
    def vae(self) -> Any:
        if self._vae is None:
            from diffusers import AutoencoderKLWan

            self._vae = AutoencoderKLWan.from_pretrained(self.path).eval().requires_grad_(False)
        return self._vae

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """``(3, T, H, W)`` in ``[-1, 1]`` -> normalised latents ``(C, F, H', W')``."""
        vae = self.vae
        dtype = next(vae.parameters()).dtype
        latents = vae.encode(video[None].to(dtype)).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean, dtype=latents.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, dtype=latents.dtype).view(1, -1, 1, 1, 1)
        return ((latents - mean) / std)[0].float()
