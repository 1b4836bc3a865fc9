"""What MindSpeed MM's diffusion models share here: the denoiser held as ``predictor`` (the module its FSDP2 YAMLs
are written against), and the mapping of those YAMLs' module paths onto a diffusers denoiser's.

MindSpeed MM's ``SoraModel`` holds the denoiser as ``predictor`` beside ``ae`` and ``text_encoder``; with
precomputed features there is no ``ae`` or ``text_encoder`` here, so an ``ignored_modules`` entry naming one is
dropped with a logged line. :class:`~lightning_mm.diffusers.wan_diffusion.WanDiffusion` and
:class:`~lightning_mm.diffusers.hunyuan15_diffusion.Hunyuan15Diffusion` add their training call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_mm.hf.mixins import FSDP2Mixin

__all__ = ["PATH_KEYS", "PredictorWrapper", "map_fsdp2_paths"]

log = logging.getLogger(__name__)

PATH_KEYS = ("sub_modules_to_wrap", "recompute_modules", "ignored_modules")
"""The FSDP2 YAML keys that hold module paths."""
_ABSENT_COMPONENTS = ("ae", "text_encoder")


class PredictorWrapper(nn.Module, FSDP2Mixin):
    """A diffusers denoiser held as ``predictor`` (state-dict keys ``predictor.<diffusers key>``)."""

    def __init__(self, predictor: nn.Module) -> None:
        super().__init__()
        # An adapted diffusers model: its init_weights / load_after_sharding / default_fsdp2_config are called by
        # name (nn.Module's attribute type, Tensor | Module, would not allow the calls).
        self.predictor: Any = predictor

    def default_fsdp2_config(self, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The predictor's defaults, with paths under ``predictor``."""
        inner = self.predictor.default_fsdp2_config(explicit) if hasattr(self.predictor, "default_fsdp2_config") else {}
        return {k: [f"predictor.{p}" for p in v] if k in PATH_KEYS else v for k, v in inner.items()}

    @torch.no_grad()
    def init_weights(self) -> None:
        self.predictor.init_weights()

    def load_after_sharding(self) -> None:
        self.predictor.load_after_sharding()


def map_fsdp2_paths(
    config: str | os.PathLike | Mapping[str, Any], rename: Callable[[str], str], owner: str
) -> dict[str, Any]:
    """A MindSpeed MM FSDP2 YAML (a path, read safely, or its mapping) with each module path of :data:`PATH_KEYS`
    passed through ``rename`` (MindSpeed MM's name -> the diffusers one, logged where it differs) and the
    ``ignored_modules`` entries ``ae`` / ``text_encoder`` dropped (not part of ``owner``). Other keys are kept."""
    from lightning_mm._utils.yaml_io import load_mapping

    raw = load_mapping(config) if isinstance(config, (str, os.PathLike)) else dict(config)
    out = dict(raw)
    for key in PATH_KEYS:
        value = raw.get(key)
        if not isinstance(value, list):
            continue
        mapped = []
        for pattern in value:
            if key == "ignored_modules" and pattern in _ABSENT_COMPONENTS:
                log.info(
                    "fsdp2_config `ignored_modules`: '%s' is not part of %s (features are precomputed): dropped",
                    pattern,
                    owner,
                )
                continue
            new = rename(pattern) if isinstance(pattern, str) else pattern
            if new != pattern:
                log.info("fsdp2_config `%s`: MindSpeed MM's '%s' is diffusers' '%s'", key, pattern, new)
            mapped.append(new)
        out[key] = mapped
    return out
