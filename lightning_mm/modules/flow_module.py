"""MMFlowMatchingModule: what MindSpeed MM's diffusion recipes share as an ``MMLightningModule`` (the model from a
``diffusers_model`` config, the ``schedule`` section, the seeded noise and timestep draw, the forward and the loss).

:class:`~lightning_mm.modules.wan_module.MMWanModule` and
:class:`~lightning_mm.modules.hunyuan15_module.MMHunyuan15Module` differ only in their schedule, their batch keys
(``get_batch``) and the wrapper that calls their diffusers transformer; each names those in class attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from copy import deepcopy
from dataclasses import fields
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import override

from lightning_mm._compat import attached_trainer
from lightning_mm._utils.suggestions import did_you_mean
from lightning_mm.diffusers.flow_matching import draw_generator
from lightning_mm.diffusers.model import DiffusersModel, DiffusersModelConfig
from lightning_mm.errors import ConfigError, InputTypeError, StateError
from lightning_mm.modules.lightning_module import MMLightningModule

__all__ = ["FLOW_KEY", "MMFlowMatchingModule"]

FLOW_KEY = "flow"
"""The batch key under which ``get_batch`` passes the draw (noise, timesteps, target) on to ``loss_func``."""


class MMFlowMatchingModule(MMLightningModule):
    """Train a diffusers transformer with one of MindSpeed MM's flow-matching recipes (a base class: a subclass
    names its schedule, its draw's type, its model wrapper and the mapper of MindSpeed MM's FSDP2 YAML paths).

    Args:
        diffusers_model: the :func:`~lightning_mm.diffusers.DiffusersModel` config; checked now.
        schedule: keys of the subclass's :attr:`schedule_class` (MindSpeed MM's ``diffusion`` section); a
            ``model_id`` other than :attr:`scheduler_id` is an error.
        noise_seed: the seed of the timesteps and noise.
        fsdp2_config: an FSDP2 YAML path or mapping, read through :attr:`fsdp2_paths` (MindSpeed MM's paths).
        **kwargs: the other arguments of :class:`MMLightningModule` (``lr``, ``warmup_steps``...).
    """

    scheduler_id: ClassVar[str]
    """MindSpeed MM's ``model_id`` of the diffusion section this module implements."""
    schedule_class: ClassVar[type]
    """The dataclass of the schedule (its fields are the accepted ``schedule`` keys)."""
    schedule_name: ClassVar[str]
    """The schedule in words, for errors (``the Wan flow-matching schedule``)."""
    sample_class: ClassVar[type]
    """The type of the draw ``get_batch`` passes to ``loss_func``."""
    wrapper: ClassVar[type[nn.Module]]
    """The trained module, built around the diffusers model (which it holds as ``predictor``)."""

    @staticmethod
    def fsdp2_paths(config: Any) -> Any:
        """An FSDP2 YAML (path or mapping) with MindSpeed MM's module paths mapped onto the wrapper's (a subclass
        names its mapper; here the YAML is taken as written)."""
        return config

    def __init__(
        self,
        diffusers_model: Mapping[str, Any],
        schedule: Mapping[str, Any] | None = None,
        noise_seed: int = 0,
        fsdp2_config: Any = None,
        **kwargs: Any,
    ) -> None:
        name = self._name()
        if kwargs.get("model_provider") is not None:
            raise ConfigError(f"{name} builds its model from `diffusers_model`; do not also give `model_provider`")
        if fsdp2_config is not None and not hasattr(fsdp2_config, "sub_modules_to_wrap"):
            fsdp2_config = type(self).fsdp2_paths(fsdp2_config)
        super().__init__(fsdp2_config=fsdp2_config, **kwargs)
        DiffusersModelConfig.from_any(deepcopy(dict(diffusers_model)))  # a bad key fails now, naming it
        self.diffusers_model = deepcopy(dict(diffusers_model))
        schedule = dict(schedule or {})
        scheduler_id = schedule.pop("model_id", self.scheduler_id)
        if scheduler_id != self.scheduler_id:
            raise ConfigError(
                f"{name} `schedule.model_id`: only {self.scheduler_id!r} is implemented, got {scheduler_id!r}"
            )
        known = [f.name for f in fields(self.schedule_class) if f.init]
        for key in schedule:
            if key not in known:
                raise ConfigError(
                    f"{name} `schedule.{key}`: not a key of {self.schedule_name}" + did_you_mean(str(key), known)
                )
        self.schedule = self.schedule_class(**schedule)
        if not isinstance(noise_seed, int) or isinstance(noise_seed, bool):
            raise ConfigError(f"{name} `noise_seed` must be an integer, got {noise_seed!r}")
        self.noise_seed = noise_seed
        self._draw_position: tuple[str, int, int] = ("", -1, 0)  # (stage, step, micro-batches drawn in it)

    @classmethod
    def _name(cls) -> str:
        """The name errors give: the first class of the package in the MRO (a user's subclass keeps its base's)."""
        return next(c.__name__ for c in cls.__mro__ if c.__module__.startswith("lightning_mm."))

    @override
    def model_provider(self) -> nn.Module:
        if self._seed.model_provider is not None:
            return super().model_provider()
        return type(self).wrapper(DiffusersModel(deepcopy(self.diffusers_model)))

    def _data_parallel_rank(self) -> int:
        """This rank's data-parallel rank: the ranks of a context-parallel group draw the same noise."""
        trainer = attached_trainer(self)
        if trainer is None:
            return 0
        cp = int(getattr(trainer.strategy, "context_parallel_size", 1) or 1)
        return int(trainer.global_rank) // cp

    def _generator(self) -> torch.Generator:
        """The generator of this micro-batch's draw: a function of ``noise_seed``, the stage, the step, the
        micro-batch within the step and the data-parallel rank only."""
        trainer = attached_trainer(self)
        stage = "none" if trainer is None else getattr(trainer.state.stage, "value", str(trainer.state.stage))
        step = 0 if trainer is None else int(trainer.global_step)
        last_stage, last_step, count = self._draw_position
        count = count + 1 if (stage, step) == (last_stage, last_step) else 0
        self._draw_position = (stage, step, count)
        return draw_generator(self.noise_seed, stage, step, count, self._data_parallel_rank())

    @override
    def forward_step(self, batch: Any) -> Any:
        if self._seed.forward_step is not None or not isinstance(batch, Mapping):
            return super().forward_step(batch)
        if self.model is None:
            raise StateError(f"{self._name()}.model is not built (configure_model has not run)")
        return self.model(**{k: v for k, v in batch.items() if k != FLOW_KEY})

    @override
    def loss_func(self, output: Any, batch: Any) -> Any:
        if self._seed.loss_func is not None:
            return super().loss_func(output, batch)
        flow = batch.get(FLOW_KEY) if isinstance(batch, Mapping) else None
        if not isinstance(flow, self.sample_class):
            raise InputTypeError(
                f"{self._name()}.loss_func needs the batch's flow-matching draw (the `{FLOW_KEY}` key of get_batch)"
            )
        return self.schedule.loss(output, flow)
