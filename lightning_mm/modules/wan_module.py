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
from copy import deepcopy
from dataclasses import fields
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_mm._compat import attached_trainer
from lightning_mm._utils.suggestions import did_you_mean
from lightning_mm.core.flop_formulas import StepFlops
from lightning_mm.diffusers.flow_matching import FlowMatchSample, WanFlowMatchSchedule, draw, draw_generator
from lightning_mm.diffusers.model import DiffusersModel, DiffusersModelConfig
from lightning_mm.diffusers.wan_diffusion import WanDiffusion, mindspeed_fsdp2_config
from lightning_mm.diffusers.wan_flops import WanFlopCounter
from lightning_mm.errors import ConfigError, DataError, InputKeyError, InputTypeError, StateError
from lightning_mm.hf.transformers_flops import UnsupportedFlopsModel
from lightning_mm.modules.lightning_module import MMLightningModule

__all__ = ["MMWanModule", "WAN_BATCH_KEYS"]

WAN_BATCH_KEYS = ("latents", "prompt_embeds", "prompt_mask", "image_embeds", "condition_latents", "control_latents")
_REQUIRED = ("latents", "prompt_embeds")
FLOW_KEY = "flow"


class MMWanModule(MMLightningModule):
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

    def __init__(
        self,
        diffusers_model: Mapping[str, Any],
        schedule: Mapping[str, Any] | None = None,
        noise_seed: int = 0,
        fsdp2_config: Any = None,
        control_scale: float = 1.0,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("model_provider") is not None:
            raise ConfigError("MMWanModule builds its model from `diffusers_model`; do not also give `model_provider`")
        if fsdp2_config is not None and not hasattr(fsdp2_config, "sub_modules_to_wrap"):
            fsdp2_config = mindspeed_fsdp2_config(fsdp2_config)
        super().__init__(fsdp2_config=fsdp2_config, **kwargs)
        DiffusersModelConfig.from_any(deepcopy(dict(diffusers_model)))  # a bad key fails now, naming it
        self.diffusers_model = deepcopy(dict(diffusers_model))
        schedule = dict(schedule or {})
        scheduler_id = schedule.pop("model_id", "wan_flow_match_scheduler")
        if scheduler_id != "wan_flow_match_scheduler":
            raise ConfigError(
                f"MMWanModule `schedule.model_id`: only 'wan_flow_match_scheduler' is implemented, got {scheduler_id!r}"
            )
        known = [f.name for f in fields(WanFlowMatchSchedule) if f.init]
        for key in schedule:
            if key not in known:
                raise ConfigError(
                    f"MMWanModule `schedule.{key}`: not a key of the Wan flow-matching schedule"
                    + did_you_mean(str(key), known)
                )
        self.schedule = WanFlowMatchSchedule(**schedule)
        if not isinstance(noise_seed, int) or isinstance(noise_seed, bool):
            raise ConfigError(f"MMWanModule `noise_seed` must be an integer, got {noise_seed!r}")
        self.noise_seed = noise_seed
        if isinstance(control_scale, bool) or not isinstance(control_scale, (int, float)):
            raise ConfigError(f"MMWanModule `control_scale` must be a number, got {control_scale!r}")
        self.control_scale = float(control_scale)
        self._draw_position: tuple[str, int, int] = ("", -1, 0)  # (stage, step, micro-batches drawn in it)
        self._wan_flops: WanFlopCounter | bool | None = None  # None: not looked for yet; False: none

    @override
    def model_provider(self) -> nn.Module:
        if self._seed.model_provider is not None:
            return super().model_provider()
        return WanDiffusion(DiffusersModel(deepcopy(self.diffusers_model)))

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

    def _data_parallel_rank(self) -> int:
        """This rank's data-parallel rank: the ranks of a context-parallel group draw the same noise."""
        trainer = attached_trainer(self)
        if trainer is None:
            return 0
        cp = int(getattr(trainer.strategy, "context_parallel_size", 1) or 1)
        return int(trainer.global_rank) // cp

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
    def _generator(self) -> torch.Generator:
        trainer = attached_trainer(self)
        stage = "none" if trainer is None else getattr(trainer.state.stage, "value", str(trainer.state.stage))
        step = 0 if trainer is None else int(trainer.global_step)
        last_stage, last_step, count = self._draw_position
        count = count + 1 if (stage, step) == (last_stage, last_step) else 0
        self._draw_position = (stage, step, count)
        return draw_generator(self.noise_seed, stage, step, count, self._data_parallel_rank())

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

    @override
    def forward_step(self, batch: Any) -> Any:
        if self._seed.forward_step is not None or not isinstance(batch, Mapping):
            return super().forward_step(batch)
        if self.model is None:
            raise StateError("MMWanModule.model is not built (configure_model has not run)")
        return self.model(**{k: v for k, v in batch.items() if k != FLOW_KEY})

    @override
    def loss_func(self, output: Any, batch: Any) -> Any:
        if self._seed.loss_func is not None:
            return super().loss_func(output, batch)
        flow = batch.get(FLOW_KEY) if isinstance(batch, Mapping) else None
        if not isinstance(flow, FlowMatchSample):
            raise InputTypeError(
                "MMWanModule.loss_func needs the batch's flow-matching draw (the `flow` key of get_batch)"
            )
        return self.schedule.loss(output, flow)
