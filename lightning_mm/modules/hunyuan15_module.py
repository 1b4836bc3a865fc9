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
from copy import deepcopy
from dataclasses import fields
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_mm._compat import attached_trainer
from lightning_mm._utils.suggestions import did_you_mean
from lightning_mm.diffusers.flow_matching import draw_generator
from lightning_mm.diffusers.hunyuan15_diffusion import Hunyuan15Diffusion, mindspeed_hunyuan15_fsdp2_config
from lightning_mm.diffusers.hunyuan15_flow import Hunyuan15FlowSample, Hunyuan15FlowSchedule, hunyuan15_draw
from lightning_mm.diffusers.model import DiffusersModel, DiffusersModelConfig
from lightning_mm.errors import ConfigError, DataError, InputKeyError, InputTypeError, StateError
from lightning_mm.modules.lightning_module import MMLightningModule

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
FLOW_KEY = "flow"
_SCHEDULER_ID = "hunyuanvideo_15_diffusion"


class MMHunyuan15Module(MMLightningModule):
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

    def __init__(
        self,
        diffusers_model: Mapping[str, Any],
        schedule: Mapping[str, Any] | None = None,
        noise_seed: int = 0,
        fsdp2_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("model_provider") is not None:
            raise ConfigError(
                "MMHunyuan15Module builds its model from `diffusers_model`; do not also give `model_provider`"
            )
        if fsdp2_config is not None and not hasattr(fsdp2_config, "sub_modules_to_wrap"):
            fsdp2_config = mindspeed_hunyuan15_fsdp2_config(fsdp2_config)
        super().__init__(fsdp2_config=fsdp2_config, **kwargs)
        DiffusersModelConfig.from_any(deepcopy(dict(diffusers_model)))  # a bad key fails now, naming it
        self.diffusers_model = deepcopy(dict(diffusers_model))
        schedule = dict(schedule or {})
        scheduler_id = schedule.pop("model_id", _SCHEDULER_ID)
        if scheduler_id != _SCHEDULER_ID:
            raise ConfigError(
                f"MMHunyuan15Module `schedule.model_id`: only {_SCHEDULER_ID!r} is implemented, got {scheduler_id!r}"
            )
        known = [f.name for f in fields(Hunyuan15FlowSchedule)]
        for key in schedule:
            if key not in known:
                raise ConfigError(
                    f"MMHunyuan15Module `schedule.{key}`: not a key of the HunyuanVideo 1.5 training schedule"
                    + did_you_mean(str(key), known)
                )
        self.schedule = Hunyuan15FlowSchedule(**schedule)
        if not isinstance(noise_seed, int) or isinstance(noise_seed, bool):
            raise ConfigError(f"MMHunyuan15Module `noise_seed` must be an integer, got {noise_seed!r}")
        self.noise_seed = noise_seed
        self._draw_position: tuple[str, int, int] = ("", -1, 0)  # (stage, step, micro-batches drawn in it)

    @override
    def model_provider(self) -> nn.Module:
        if self._seed.model_provider is not None:
            return super().model_provider()
        return Hunyuan15Diffusion(DiffusersModel(deepcopy(self.diffusers_model)))

    def _generator(self) -> torch.Generator:
        trainer = attached_trainer(self)
        stage = "none" if trainer is None else getattr(trainer.state.stage, "value", str(trainer.state.stage))
        step = 0 if trainer is None else int(trainer.global_step)
        last_stage, last_step, count = self._draw_position
        count = count + 1 if (stage, step) == (last_stage, last_step) else 0
        self._draw_position = (stage, step, count)
        rank = 0 if trainer is None else int(trainer.global_rank)
        return draw_generator(self.noise_seed, stage, step, count, rank)

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

    @override
    def forward_step(self, batch: Any) -> Any:
        if self._seed.forward_step is not None or not isinstance(batch, Mapping):
            return super().forward_step(batch)
        if self.model is None:
            raise StateError("MMHunyuan15Module.model is not built (configure_model has not run)")
        return self.model(**{k: v for k, v in batch.items() if k != FLOW_KEY})

    @override
    def loss_func(self, output: Any, batch: Any) -> Any:
        if self._seed.loss_func is not None:
            return super().loss_func(output, batch)
        flow = batch.get(FLOW_KEY) if isinstance(batch, Mapping) else None
        if not isinstance(flow, Hunyuan15FlowSample):
            raise InputTypeError(
                "MMHunyuan15Module.loss_func needs the batch's flow-matching draw (the `flow` key of get_batch)"
            )
        return self.schedule.loss(output, flow)
