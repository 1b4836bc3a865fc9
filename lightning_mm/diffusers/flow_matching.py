"""The flow-matching schedule of MindSpeed MM's Wan recipe (``wan_flow_match_scheduler``), for training.

With ``N = num_train_timesteps`` the training sigmas are ``N`` points from ``sigma_max`` down to ``sigma_min``
(``N + 1`` points without the last with ``extra_one_step``), shifted as ``shift * s / (1 + (shift - 1) * s)``;
the timesteps are ``sigma * N``. A step draws one timestep index per micro-batch, uniformly in
``[min_timestep_boundary * N, max_timestep_boundary * N)``; the noisy latents are ``(1 - sigma) * x0 + sigma *
noise``, the target is the velocity ``noise - x0``, and the loss is the mean squared error times the timestep's
weight ``w(t) ~ exp(-2 ((t - N/2) / N)^2)`` (shifted to a minimum of 0, normalised to a mean of 1 over the
timesteps).

The defaults are those of every Wan 2.1 / 2.2 recipe of MindSpeed MM (``examples/wan2.*/**/pretrain_model*.json``:
``num_train_timesteps: 1000, shift: 5, sigma_min: 0.0, extra_one_step: true``; Wan 2.2 A14B's high- and low-noise
experts set the boundaries to ``[0, 0.417)`` and ``[0.417, 1)``). Pure torch: no diffusers needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_mm.errors import ConfigError, DataError

__all__ = ["FlowMatchSample", "WanFlowMatchSchedule", "draw", "draw_generator"]


@dataclass(frozen=True)
class FlowMatchSample:
    """One micro-batch's draw: the noisy latents the model sees, its timestep and the velocity target."""

    noisy: Tensor
    timestep: Tensor
    """Shape ``(batch,)``: the drawn timestep for every sample of the micro-batch (float)."""
    target: Tensor
    weight: Tensor
    """The loss weight of the timestep (a scalar tensor)."""
    index: int


@dataclass(frozen=True)
class WanFlowMatchSchedule:
    """MindSpeed MM's ``WanFlowMatchScheduler`` training side (see the module docstring)."""

    num_train_timesteps: int = 1000
    shift: float = 5.0
    sigma_max: float = 1.0
    sigma_min: float = 0.0
    extra_one_step: bool = True
    min_timestep_boundary: float = 0.0
    max_timestep_boundary: float = 1.0
    sigmas: Tensor = field(init=False, repr=False)
    timesteps: Tensor = field(init=False, repr=False)
    weights: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.num_train_timesteps
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"num_train_timesteps must be a positive integer, got {n!r}")
        if not self.shift > 0:
            raise ConfigError(f"shift must be > 0, got {self.shift!r}")
        if not 0 <= self.sigma_min < self.sigma_max <= 1:
            raise ConfigError(f"need 0 <= sigma_min < sigma_max <= 1, got {self.sigma_min}, {self.sigma_max}")
        if not 0 <= self.min_timestep_boundary < self.max_timestep_boundary <= 1:
            raise ConfigError(
                "min_timestep_boundary and max_timestep_boundary must satisfy 0 <= min < max <= 1, got "
                f"{self.min_timestep_boundary}, {self.max_timestep_boundary}"
            )
        if int(self.min_timestep_boundary * n) >= int(self.max_timestep_boundary * n):
            raise ConfigError(
                f"the timestep boundaries [{self.min_timestep_boundary}, {self.max_timestep_boundary}) "
                f"hold no timestep index of {n}"
            )
        if self.extra_one_step:
            sigmas = torch.linspace(self.sigma_max, self.sigma_min, n + 1)[:-1]
        else:
            sigmas = torch.linspace(self.sigma_max, self.sigma_min, n)
        sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        timesteps = sigmas * n
        y = torch.exp(-2 * ((timesteps - n / 2) / n) ** 2)
        y = y - y.min()
        object.__setattr__(self, "sigmas", sigmas)
        object.__setattr__(self, "timesteps", timesteps)
        object.__setattr__(self, "weights", y * (n / y.sum()))

    def draw_index(self, generator: torch.Generator | None = None) -> int:
        """One timestep index, uniform over the boundaries (drawn on the CPU: the same on every device)."""
        n = self.num_train_timesteps
        low, high = int(self.min_timestep_boundary * n), int(self.max_timestep_boundary * n)
        return int(torch.randint(low, high, (1,), generator=generator).item())

    def sample(self, latents: Tensor, noise: Tensor, index: int) -> FlowMatchSample:
        """Noise ``latents`` at timestep ``index`` with ``noise`` (same shape)."""
        if noise.shape != latents.shape:
            raise DataError(f"noise {list(noise.shape)} and latents {list(latents.shape)} differ in shape")
        sigma = self.sigmas[index].to(latents.device, latents.dtype)
        noisy = (1 - sigma) * latents + sigma * noise
        timestep = self.timesteps[index].to(latents.device).expand(latents.shape[0]).clone()
        return FlowMatchSample(noisy, timestep, noise - latents, self.weights[index].to(latents.device), index)

    @staticmethod
    def loss(prediction: Tensor, sample: FlowMatchSample) -> Tensor:
        """The weighted mean squared error of the predicted velocity (in fp32)."""
        mse = torch.nn.functional.mse_loss(prediction.float(), sample.target.float())
        return mse * sample.weight


def draw_generator(seed: int, stage: str, step: int, micro_batch: int, data_rank: int) -> torch.Generator:
    """The CPU generator of one micro-batch's timestep and noise: a function of the run's seed, the stage, the
    optimizer step, the micro-batch within the step and the data-parallel rank alone (so a resumed run, or a
    one-process reference replaying each rank's micro-batches, draws the same numbers)."""
    import hashlib

    text = f"{seed}:{stage}:{step}:{micro_batch}:{data_rank}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1)


def draw(schedule: WanFlowMatchSchedule, latents: Tensor, generator: torch.Generator) -> FlowMatchSample:
    """One micro-batch's timestep index, then its noise (fp32, on the CPU, then moved), from ``generator``."""
    index = schedule.draw_index(generator)
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device, latents.dtype)
    return schedule.sample(latents, noise, index)
