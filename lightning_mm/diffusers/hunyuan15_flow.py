"""The flow-matching training draw of MindSpeed MM's HunyuanVideo 1.5 recipe (``hunyuanvideo_15_diffusion``).

MindSpeed MM's ``Hunyuan_15_FlowMatchDiscreteScheduler.q_sample`` (``mindspeed_mm/models/diffusion/
hunyuan_video_15_scheduler.py``) draws, per sample, Gaussian noise and a continuous timestep: with ``T =
num_train_timesteps`` and ``eps = 1e-5``, ``t = (sigmoid(u) (1 - 2 eps) + eps) T`` for ``u ~ N(0, 1)`` (``snr:
lognorm``) or ``t = (r (1 - 2 eps) + eps) T`` for ``r ~ U(0, 1)`` (``snr: uniform``), shifted as ``s t' / (1 + (s -
1) t')`` on ``t' = t / T`` with ``s = train_timestep_shift``. The noisy latents are ``(1 - t/T) x0 + (t/T) noise``;
the model sees ``t``; the target is the velocity ``noise - x0`` and the loss the plain mean squared error
(``training_losses`` without ``precondition_outputs``). The keys ``shift``, ``reverse`` and ``solver`` are the
sampler's (inference) and do not enter training. Pure torch: no diffusers needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_mm.errors import ConfigError

__all__ = ["Hunyuan15FlowSample", "Hunyuan15FlowSchedule", "hunyuan15_draw"]

TRAIN_EPS = 1e-5
SNR_TYPES = ("lognorm", "uniform")


@dataclass(frozen=True)
class Hunyuan15FlowSample:
    """One micro-batch's draw: the noisy latents, the timesteps ``(batch,)`` the model sees, the velocity target."""

    noisy: Tensor
    timestep: Tensor
    target: Tensor


@dataclass(frozen=True)
class Hunyuan15FlowSchedule:
    """The training side of MindSpeed MM's ``Hunyuan_15_FlowMatchDiscreteScheduler`` (see the module docstring)."""

    num_train_timesteps: int = 1000
    train_timestep_shift: float = 3.0
    snr: str = "lognorm"

    def __post_init__(self) -> None:
        n = self.num_train_timesteps
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"num_train_timesteps must be a positive integer, got {n!r}")
        shift = self.train_timestep_shift
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not shift > 0:
            raise ConfigError(f"train_timestep_shift must be a number > 0, got {shift!r}")
        if self.snr not in SNR_TYPES:
            raise ConfigError(f"snr must be one of {list(SNR_TYPES)}, got {self.snr!r}")

    def timesteps(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        """``batch`` shifted training timesteps in ``(0, T)`` (fp32, drawn on the CPU)."""
        if self.snr == "lognorm":
            fraction = torch.sigmoid(torch.randn((batch,), generator=generator, dtype=torch.float32))
        else:
            fraction = torch.rand((batch,), generator=generator, dtype=torch.float32)
        t = fraction * (1 - 2 * TRAIN_EPS) + TRAIN_EPS
        shift = float(self.train_timestep_shift)
        if shift != 1.0:
            t = shift * t / (1 + (shift - 1) * t)
        return t * self.num_train_timesteps

    def sample(self, latents: Tensor, noise: Tensor, timestep: Tensor) -> Hunyuan15FlowSample:
        """Noise ``latents`` ``(B, C, F, H, W)`` with ``noise`` at ``timestep`` ``(B,)``."""
        fraction = (timestep / self.num_train_timesteps).to(latents.device, latents.dtype)
        fraction = fraction.view(-1, *([1] * (latents.ndim - 1)))
        noisy = (1 - fraction) * latents + fraction * noise
        return Hunyuan15FlowSample(noisy, timestep.to(latents.device), noise - latents)

    @staticmethod
    def loss(prediction: Tensor, sample: Hunyuan15FlowSample) -> Tensor:
        """The mean squared error of the predicted velocity (in fp32)."""
        return torch.nn.functional.mse_loss(prediction.float(), sample.target.float())


def hunyuan15_draw(schedule: Hunyuan15FlowSchedule, latents: Tensor, generator: torch.Generator) -> Hunyuan15FlowSample:
    """One micro-batch's noise (fp32, on the CPU, then moved), then its timesteps, from ``generator``: the order of
    MindSpeed MM's ``q_sample`` (``randn_like`` first, then the timestep sampler)."""
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device, latents.dtype)
    timestep = schedule.timesteps(int(latents.shape[0]), generator)
    return schedule.sample(latents, noise, timestep)
