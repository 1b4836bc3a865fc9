"""The seed's model mixins: ``MultiModalModule``, ``FSDP2Mixin`` and ``WeightInitMixin``.

A MindSpeed MM model is declared ``class CustomModel(MultiModalModule, FSDP2Mixin, WeightInitMixin)`` and needs
no other change to be sharded by :class:`~lightning_mm.MMFSDP2Strategy` and initialised after meta-device
construction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MultiModalModule", "FSDP2Mixin", "WeightInitMixin"]


class MultiModalModule(nn.Module):
    """Base class of MindSpeed MM models: an ``nn.Module`` that keeps the ``config`` it was built from."""

    def __init__(self, config: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = config


class FSDP2Mixin:
    """Gives a model a default sharding plan and the seed's ``_fully_shard`` escape hatch.

    * ``default_fsdp2_config()`` returns YAML keys (``sub_modules_to_wrap``, ``recompute_modules``, ...) that the
      strategy uses where the user's YAML leaves them empty.
    * Overriding ``_fully_shard(fsdp2_kwargs, fsdp2_config)`` takes the wrapping of sub-modules over; the strategy
      still builds the mesh and the ``fully_shard`` kwargs, applies recomputation, and shards the root afterwards.
      ``self.fsdp2_config`` is set before the call, as in MindSpeed MM.
    """

    fsdp2_config: Any = None

    def default_fsdp2_config(self) -> dict[str, Any]:
        """YAML defaults for this model (empty: the user's YAML decides)."""
        return {}

    def _fully_shard(self, fsdp2_kwargs: dict[str, Any] | None = None, fsdp2_config: Any = None) -> None:
        """Shard the sub-modules named by ``fsdp2_config.sub_modules_to_wrap`` (what the strategy does itself).

        Custom implementations may call this through ``super()`` and add to it.
        """
        from torch.distributed.fsdp import fully_shard

        from lightning_mm.strategies.plan import build_plan

        assert isinstance(self, nn.Module) and fsdp2_kwargs is not None and fsdp2_config is not None
        plan = build_plan(fsdp2_config, self, fsdp2_kwargs["mesh"].size())
        for unit in plan.units:
            modules = [self.get_submodule(path) for path in unit.modules]
            fully_shard(modules if len(modules) > 1 else modules[0], **fsdp2_kwargs)


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
if hasattr(nn, "RMSNorm"):
    _NORMS = (*_NORMS, nn.RMSNorm)


class WeightInitMixin:
    """``init_weights()``: what fills a model's parameters after meta-device materialisation.

    A model with a Hugging Face ``_init_weights(module)`` gets it applied to every submodule. Otherwise:
    Linear, Conv and Embedding weights ~ N(0, std) (``config.initializer_range`` or 0.02), biases zero, norm
    weights one, and any other module with a ``reset_parameters()`` resets itself.
    """

    init_std: float = 0.02

    def _init_std(self) -> float:
        config = getattr(self, "config", None)
        return float(getattr(config, "initializer_range", None) or self.init_std)

    @torch.no_grad()
    def init_weights(self) -> None:
        assert isinstance(self, nn.Module)
        hf_init = getattr(self, "_init_weights", None)
        std = self._init_std()
        for module in self.modules():
            if callable(hf_init):
                hf_init(module)
            else:
                init_module(module, std)


@torch.no_grad()
def init_module(module: nn.Module, std: float = 0.02) -> None:
    """Initialise the parameters ``module`` owns directly (not those of its children)."""
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif isinstance(module, _NORMS):
        if getattr(module, "weight", None) is not None:
            nn.init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
