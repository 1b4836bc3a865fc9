"""MMHunyuan15Module: MindSpeed MM's HunyuanVideo 1.5 training step (text- and image-to-video, flow matching on
precomputed features) as an ``MMLightningModule``.

The data gives each sample's video latents and its two text encoders' states (precomputed, in the layout MindSpeed
MM's training reads with ``load_video_features`` / ``load_text_features: true``: the VAE, the MLLM text encoder and
the byT5 glyph encoder ran beforehand). A step, as
MindSpeed MM's ``SoraModel`` with ``hunyuanvideo_15_diffusion`` and ``hunyuanvideo15dit``:

* ``get_batch``: Gaussian noise, then one timestep per sample (:func:`~lightning_mm.diffusers.hunyuan15_flow.
  hunyuan15_draw`, from a generator that depends only on ``noise_seed``, the step, the micro-batch and the
  data-parallel rank: :func:`~lightning_mm.diffusers.flow_matching.draw_generator`), the noisy latents;
* ``forward_step``: diffusers' ``HunyuanVideo15Transformer3DModel`` (``self.model.predictor``, called by
  :class:`~lightning_mm.diffusers.hunyuan15_diffusion.Hunyuan15Diffusion`) predicts the velocity;
* ``loss_func``: the mean squared error to ``noise - x0``.

Batch keys: ``latents`` ``(B, C, F, H, W)``, ``prompt_embeds`` ``(B, L, D)`` and ``prompt_mask`` ``(B, L)`` (the
MLLM's states), ``prompt_embeds_2`` ``(B, L2, D2)`` and ``prompt_mask_2`` ``(B, L2)`` (byT5's); for image-to-video
also ``condition_latents`` ``(B, C + 1, F, H, W)`` (the first frame's latents and its mask, MindSpeed MM's
``cond_latents``) and ``image_embeds`` ``(B, N, E)`` (its SigLIP states, MindSpeed MM's ``vision_states``), both or
neither. Any other key is an error. Passing MindSpeed MM's ``get_batch`` / ``forward_step`` / ``loss_func``
replaces the matching hook, as for every ``MMLightningModule``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from lightning_mm.diffusers.hunyuan15_diffusion import Hunyuan15Diffusion, mindspeed_hunyuan15_fsdp2_config
from lightning_mm.diffusers.hunyuan15_flow import Hunyuan15FlowSample, Hunyuan15FlowSchedule, hunyuan15_draw
from lightning_mm.errors import DataError, InputKeyError, InputTypeError
from lightning_mm.modules.flow_module import FLOW_KEY, MMFlowMatchingModule

__all__ = ["HUNYUAN15_BATCH_KEYS", "MMHunyuan15Module"]

HUNYUAN15_BATCH_KEYS = (
    "latents",
    "prompt_embeds",
    "prompt_mask",
    "prompt_embeds_2",
    "prompt_mask_2",
    "condition_latents",
    "image_embeds",
)
_REQUIRED = HUNYUAN15_BATCH_KEYS[:5]
_IMAGE_KEYS = ("condition_latents", "image_embeds")


class MMHunyuan15Module(MMFlowMatchingModule):
    """Train a HunyuanVideo 1.5 diffusers transformer (t2v, i2v) with MindSpeed MM's flow-matching recipe.

    Args:
        diffusers_model: the :func:`~lightning_mm.diffusers.DiffusersModel` config (``init_from_path``, ``config``,
            ``model_id``, ``freeze``, ``lora``); checked now.
        schedule: :class:`~lightning_mm.diffusers.hunyuan15_flow.Hunyuan15FlowSchedule` keys (MindSpeed MM's
            ``diffusion`` section: ``num_train_timesteps``, ``train_timestep_shift``, ``snr``); a ``model_id`` other
            than ``hunyuanvideo_15_diffusion`` is an error.
        noise_seed: the seed of the timesteps and noise.
        fsdp2_config: an FSDP2 YAML path or mapping; MindSpeed MM's HunyuanVideo 1.5 YAML is read as written
            (:func:`~lightning_mm.diffusers.hunyuan15_diffusion.mindspeed_hunyuan15_fsdp2_config` maps its paths).
        **kwargs: the other arguments of :class:`MMLightningModule` (``lr``, ``warmup_steps``...).
    """

    scheduler_id = "hunyuanvideo_15_diffusion"
    schedule_class = Hunyuan15FlowSchedule
    schedule_name = "the HunyuanVideo 1.5 training schedule"
    sample_class = Hunyuan15FlowSample
    wrapper = Hunyuan15Diffusion
    fsdp2_paths = staticmethod(mindspeed_hunyuan15_fsdp2_config)

    @override
    def get_batch(self, batch: Any) -> dict[str, Any]:
        """The model inputs of a batch: noisy latents, timesteps, both text conditions, and the draw."""
        if self._seed.get_batch is not None:
            batch = super().get_batch(batch)
        if not isinstance(batch, Mapping):
            raise InputTypeError(
                f"MMHunyuan15Module: a batch must be a mapping with keys {list(_REQUIRED)}, got {type(batch).__name__}"
            )
        unknown = sorted(set(batch) - set(HUNYUAN15_BATCH_KEYS))
        missing = [k for k in _REQUIRED if k not in batch]
        if (_IMAGE_KEYS[0] in batch) != (_IMAGE_KEYS[1] in batch):
            missing += [k for k in _IMAGE_KEYS if k not in batch]
        if unknown or missing:
            raise InputKeyError(
                f"MMHunyuan15Module: batch keys {sorted(batch)}: "
                + "; ".join(([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else []))
            )
        latents = batch["latents"]
        if not isinstance(latents, torch.Tensor) or latents.ndim != 5:
            raise DataError(
                "MMHunyuan15Module: `latents` must be a (batch, channels, frames, height, width) tensor, got "
                f"{getattr(latents, 'shape', type(latents).__name__)}"
            )
        for text, mask in (("prompt_embeds", "prompt_mask"), ("prompt_embeds_2", "prompt_mask_2")):
            states, valid = batch[text], batch[mask]
            if (
                not isinstance(states, torch.Tensor)
                or not isinstance(valid, torch.Tensor)
                or states.ndim != 3
                or tuple(valid.shape) != tuple(states.shape[:2])
            ):
                raise DataError(
                    f"MMHunyuan15Module: `{text}` must be (batch, length, dim) and `{mask}` (batch, length), got "
                    f"{getattr(states, 'shape', None)} and {getattr(valid, 'shape', None)}"
                )
        image = batch.get("condition_latents")
        if image is not None and (
            not isinstance(image, torch.Tensor)
            or tuple(image.shape) != (latents.shape[0], latents.shape[1] + 1, *latents.shape[2:])
        ):
            raise DataError(
                "MMHunyuan15Module: `condition_latents` must be (batch, channels + 1, frames, height, width) for "
                f"`latents` {tuple(latents.shape)}, got {getattr(image, 'shape', type(image).__name__)}"
            )
        flow = hunyuan15_draw(self.schedule, latents, self._generator())
        extra = {} if image is None else {"condition": image, "image_embeds": batch["image_embeds"]}
        return {
            **extra,
            "hidden_states": flow.noisy,
            "timestep": flow.timestep,
            "encoder_hidden_states": batch["prompt_embeds"],
            "encoder_attention_mask": batch["prompt_mask"],
            "encoder_hidden_states_2": batch["prompt_embeds_2"],
            "encoder_attention_mask_2": batch["prompt_mask_2"],
            FLOW_KEY: flow,
        }
