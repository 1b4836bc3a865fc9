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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_mm.datamodules.records import DataError

__all__ = ["read_frames", "to_model_frames", "FrozenWanVAE"]


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


def to_model_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``uint8 (T, H, W, 3)`` -> ``float32 (3, T, height, width)`` in ``[-1, 1]``: short-side resize, centre crop."""
    video = frames.permute(0, 3, 1, 2).float()  # (T, 3, H, W)
    h, w = video.shape[-2:]
    scale = max(height / h, width / w)
    size = (max(height, round(h * scale)), max(width, round(w * scale)))
    if size != (h, w):
        video = F.interpolate(video, size=size, mode="bilinear", antialias=True, align_corners=False)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    video = video[..., top : top + height, left : left + width]
    video = (video / 255.0 - 0.5) / 0.5
    return video.permute(1, 0, 2, 3).contiguous()


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
