"""The one test for "is a normalisation layer", used by the sharding plan (:mod:`lightning_mm.core.sharding_plan`: norms
beside the wrapped blocks join the aligned unit), the default plans (:mod:`lightning_mm.hf.default_plans`: a norm
stays in the root unit) and weight initialisation (:mod:`lightning_mm.hf.mixins`: torch's norms get weight one,
bias zero)."""

from __future__ import annotations

import re

from torch import nn

__all__ = ["TORCH_NORMS", "is_norm"]

TORCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
"""torch's normalisation layers: their ``reset_parameters`` sets the weight to one and the bias to zero."""

_NORM_NAME = re.compile(r"Norm(?![a-z])")  # RMSNorm, Qwen3_5MoeRMSNormGated, FP32LayerNorm, LayerNorm2d; not Normal


def is_norm(module: nn.Module, by_name: bool = True) -> bool:
    """Whether ``module`` is a normalisation layer: an instance of one of :data:`TORCH_NORMS` or, with ``by_name``,
    of a class whose name has ``Norm`` as a word (Transformers' ``Qwen2RMSNorm``, ``Qwen3_5MoeRMSNormGated``,
    diffusers' ``FP32LayerNorm``). Initialisation asks ``by_name=False``: a model's own norm classes initialise as
    their constructor does (Gemma's RMSNorm, which scales by ``1 + weight``, starts at zero)."""
    if isinstance(module, TORCH_NORMS):
        return True
    return by_name and _NORM_NAME.search(type(module).__name__) is not None
