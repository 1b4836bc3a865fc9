"""MMWanModule: MindSpeed MM's Wan 2.x training step (flow matching on precomputed features) as an
``MMLightningModule``.

The data gives each sample's video latents and text embeddings (MindSpeed MM's ``feature`` datasets: the VAE and
the text encoder ran beforehand). A step, as MindSpeed MM's ``SoraModel`` with ``wan_flow_match_scheduler``:

* ``get_batch``: one timestep per micro-batch and Gaussian noise (:func:`~lightning_mm.diffusers.flow_matching.draw`,
  from a generator that depends only on ``noise_seed``, the step, the micro-batch and the data-parallel rank), the
  noisy latents ``(1 - sigma) x0 + sigma noise``;
* ``forward_step``: the diffusers ``WanTransformer3DModel`` (``self.model.predictor``) predicts the velocity;
* ``loss_func``: the mean squared error to ``noise - x0``, times the timestep's weight.

Batch keys: ``latents`` ``(B, C, F, H, W)`` and ``prompt_embeds`` ``(B, L, D)``, optionally ``prompt_mask``
``(B, L)`` (embeddings past the mask are zeroed, as diffusers' Wan pipeline pads them), and for image-to-video
``image_embeds`` (CLIP features) and ``condition_latents`` (mask and first-frame latents concatenated on the
channels; diffusers' Wan i2v attention takes the last 512 text positions as the prompt, so its ``prompt_embeds``
are 512 long, as Wan's pipeline pads them); a Wan VACE model (diffusers' ``WanVACETransformer3DModel``) needs
``control_latents`` ``(B, 96, F, H, W)`` (MindSpeed MM's ``vace_context``: inactive and reactive video latents and
the 8x8 mask, its ``control_hidden_states``), which only a VACE model takes. Any other key is an error. With
``MMFSDP2Strategy(context_parallel_size=C)`` the video tokens are split over the ``C`` ranks of each group
(Ulysses: :mod:`lightning_mm.diffusers.wan_context_parallel`). Passing MindSpeed MM's ``get_batch`` /
``forward_step`` / ``loss_func`` replaces the matching hook, as for every ``MMLightningModule``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_mm.core.flop_formulas import StepFlops
from lightning_mm.diffusers.flow_matching import FlowMatchSample, WanFlowMatchSchedule, draw
from lightning_mm.diffusers.wan_diffusion import WanDiffusion, mindspeed_fsdp2_config
from lightning_mm.diffusers.wan_flops import WanFlopCounter
from lightning_mm.errors import ConfigError, DataError, InputKeyError, InputTypeError
from lightning_mm.hf.transformers_flops import UnsupportedFlopsModel
from lightning_mm.modules.flow_module import FLOW_KEY, MMFlowMatchingModule
from lightning_mm.modules.lightning_module import MMLightningModule

__all__ = ["MMWanModule", "WAN_BATCH_KEYS"]

WAN_BATCH_KEYS = ("latents", "prompt_embeds", "prompt_mask", "image_embeds", "condition_latents", "control_latents")
_REQUIRED = ("latents", "prompt_embeds")


class MMWanModule(MMFlowMatchingModule):
    """Train a Wan 2.x diffusers transformer with MindSpeed MM's flow-matching recipe.

    Args:
        diffusers_model: the :func:`~lightning_mm.diffusers.DiffusersModel` config (``init_from_path``, ``config``,
            ``model_id``, ``freeze``, ``lora``: PEFT adapters, see :mod:`lightning_mm.hf.lora`); checked now.
        schedule: :class:`~lightning_mm.diffusers.WanFlowMatchSchedule` keys (MindSpeed MM's ``diffusion`` section:
            ``num_train_timesteps``, ``shift``, ``sigma_min``, ``sigma_max``, ``extra_one_step``,
            ``min_timestep_boundary``, ``max_timestep_boundary``); a ``model_id`` other than
            ``wan_flow_match_scheduler`` is an error.
        noise_seed: the seed of the timesteps and noise.
        control_scale: a VACE model's weight of each VACE block's hint (MindSpeed MM's ``vace_scale``, 1.0 in its
            training); an error for another model.
        fsdp2_config: an FSDP2 YAML path or mapping; MindSpeed MM's Wan YAMLs are read as written
            (:func:`~lightning_mm.diffusers.wan_diffusion.mindspeed_fsdp2_config` maps their paths).
        **kwargs: the other arguments of :class:`MMLightningModule` (``lr``, ``warmup_steps``...).
    """

    scheduler_id = "wan_flow_match_scheduler"
    schedule_class = WanFlowMatchSchedule
    schedule_name = "the Wan flow-matching schedule"
    sample_class = FlowMatchSample
    wrapper = WanDiffusion
    fsdp2_paths = staticmethod(mindspeed_fsdp2_config)

    def __init__(
        self,
        diffusers_model: Mapping[str, Any],
        schedule: Mapping[str, Any] | None = None,
        noise_seed: int = 0,
        fsdp2_config: Any = None,
        control_scale: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(diffusers_model, schedule, noise_seed, fsdp2_config, **kwargs)
        if isinstance(control_scale, bool) or not isinstance(control_scale, (int, float)):
            raise ConfigError(f"MMWanModule `control_scale` must be a number, got {control_scale!r}")
        self.control_scale = float(control_scale)
        self._wan_flops: WanFlopCounter | bool | None = None  # None: not looked for yet; False: none

    handles_context_parallel = True
    """Under ``MMFSDP2Strategy(context_parallel_size=C)`` the video tokens are split over the ``C`` ranks of a
    group (:func:`~lightning_mm.diffusers.wan_context_parallel.enable_wan_context_parallel`)."""

    @override
    def configure_model(self) -> None:
        super().configure_model()
        group = self.context_parallel_group
        if group is not None:
            from lightning_mm.diffusers.wan_context_parallel import enable_wan_context_parallel

            predictor = getattr(self.model, "predictor", None)
            if predictor is None:
                raise ConfigError(
                    f"MMWanModule: context parallelism needs a model with a Wan `predictor`, got "
                    f"{type(self.model).__name__}"
                )
            if getattr(getattr(predictor, "config", None), "vace_layers", None) is not None:
                raise ConfigError(
                    "MMWanModule: context parallelism is not implemented for Wan VACE (the control branch's tokens "
                    "are not split); use context_parallel_size 1"
                )
            enable_wan_context_parallel(predictor, group)

    # ----------------------------------------------------------------------------------------- FLOPs
    @override
    def step_flops(self, batch: Any) -> StepFlops | None:
        """The FLOPs of a training step over ``batch`` (:class:`~lightning_mm.diffusers.wan_flops.WanFlopCounter`:
        its ``latents`` shape and ``prompt_embeds`` / ``image_embeds`` lengths), ``None`` for a model without a Wan
        ``predictor`` or when ``flops_per_batch`` is the user's own; sets ``flops_per_batch`` to its model FLOPs."""
        counter = self._wan_counter()
        if counter is None or not isinstance(batch, Mapping) or not isinstance(batch.get("latents"), torch.Tensor):
            return None
        text, image = batch.get("prompt_embeds"), batch.get("image_embeds")
        if not isinstance(text, torch.Tensor):
            return None
        flops = counter(
            batch["latents"].shape, int(text.shape[1]), int(image.shape[1]) if isinstance(image, torch.Tensor) else 0
        )
        self.flops_per_batch = flops.model
        return flops

    def _wan_counter(self) -> WanFlopCounter | None:
        if self._wan_flops is None:
            self._wan_flops = False
            owners = [c for c in type(self).__mro__ if "flops_per_batch" in vars(c)]
            if "flops_per_batch" in self.__dict__ or owners[0] is not MMLightningModule:  # the user's own
                return None
            predictor = getattr(self.model, "predictor", None)
            if isinstance(predictor, nn.Module):
                try:
                    self._wan_flops = WanFlopCounter.from_model(predictor, self._recomputed(predictor)[2])
                except UnsupportedFlopsModel as error:
                    rank_zero_info(f"no FLOPs, TFLOP/s or MFU are logged: {error}")
        return self._wan_flops if isinstance(self._wan_flops, WanFlopCounter) else None

    # ----------------------------------------------------------------------------------------- the step
    @override
    def get_batch(self, batch: Any) -> dict[str, Any]:
        """The model inputs of a batch: noisy latents, timesteps, text (and image) conditions, and the draw."""
        if self._seed.get_batch is not None:
            batch = super().get_batch(batch)
        if not isinstance(batch, Mapping):
            raise InputTypeError(
                f"MMWanModule: a batch must be a mapping with keys {list(_REQUIRED)}, got {type(batch).__name__}"
            )
        unknown = sorted(set(batch) - set(WAN_BATCH_KEYS))
        missing = [k for k in _REQUIRED if k not in batch]
        if unknown or missing:
            raise InputKeyError(
                f"MMWanModule: batch keys {sorted(batch)}: "
                + "; ".join(
                    ([f"missing {missing}"] if missing else [])
                    + ([f"unknown {unknown} (known: {list(WAN_BATCH_KEYS)})"] if unknown else [])
                )
            )
        latents = batch["latents"]
        if not isinstance(latents, torch.Tensor) or latents.ndim != 5:
            raise DataError(
                f"MMWanModule: `latents` must be a (batch, channels, frames, height, width) tensor, got "
                f"{getattr(latents, 'shape', type(latents).__name__)}"
            )
        text = batch["prompt_embeds"]
        if batch.get("prompt_mask") is not None:
            text = text * batch["prompt_mask"].to(text.dtype).unsqueeze(-1)
        flow = draw(self.schedule, latents, self._generator())
        inputs: dict[str, Any] = {"hidden_states": flow.noisy, "timestep": flow.timestep, "encoder_hidden_states": text}
        if batch.get("image_embeds") is not None:
            inputs["encoder_hidden_states_image"] = batch["image_embeds"]
        if batch.get("condition_latents") is not None:
            inputs["condition"] = batch["condition_latents"]
        self._check_control(batch.get("control_latents"))
        if batch.get("control_latents") is not None:
            inputs["control"] = batch["control_latents"]
            inputs["control_scale"] = self.control_scale
        inputs[FLOW_KEY] = flow
        return inputs

    def _check_control(self, control: Any) -> None:
        """A VACE model needs ``control_latents``; another model must not get them."""
        predictor = getattr(self.model, "predictor", None)
        config = getattr(predictor, "config", None)
        if config is None:
            return
        vace = getattr(config, "vace_layers", None) is not None
        if vace and not isinstance(control, torch.Tensor):
            raise InputKeyError(
                f"MMWanModule: the model is {type(predictor).__name__} (Wan VACE): a batch needs `control_latents` "
                "(MindSpeed MM's `vace_context` features)"
            )
        if not vace and control is not None:
            raise InputKeyError(
                f"MMWanModule: `control_latents` (VACE control features) given, but the model is "
                f"{type(predictor).__name__}, which takes none"
            )
        if not vace and self.control_scale != 1.0:
            raise ConfigError(f"MMWanModule `control_scale`: {type(predictor).__name__} is not a VACE model")
