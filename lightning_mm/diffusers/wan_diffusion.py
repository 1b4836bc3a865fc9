"""``WanDiffusion``: the module MindSpeed MM's Wan FSDP2 YAMLs are written against (``predictor.blocks.{*}``).

MindSpeed MM's ``SoraModel`` holds the denoiser as ``predictor`` (beside ``ae`` and ``text_encoder``); its FSDP2
YAMLs name paths under it. ``WanDiffusion`` is that container for a diffusers denoiser: ``predictor`` is the
adapted ``WanTransformer3DModel`` (state-dict keys ``predictor.<diffusers key>``). Latents and text embeddings
come precomputed with the data (MindSpeed MM's ``load_video_features`` / ``load_text_features`` recipes), so there
is no ``ae`` or ``text_encoder`` here.

:func:`mindspeed_fsdp2_config` reads such a YAML as written and maps the names of MindSpeed MM's own Wan DiT that
diffusers calls otherwise: ``predictor.head`` (norm, projection and modulation table) is diffusers' ``proj_out``
(its norm has no parameters, its modulation table ``scale_shift_table`` belongs to the predictor and stays with
the root unit). MindSpeed MM's VACE model (``VACEModel``) holds the Wan DiT as ``predictor.wan_dit`` and its control
branch as ``predictor.vace_dit`` (``vace_blocks``, ``vace_patch_embedding``); diffusers' ``WanVACETransformer3DModel``
holds both at its top level, so those two prefixes are dropped (``predictor.wan_dit.head`` is ``predictor.proj_out``).
``ignored_modules`` naming ``ae`` / ``text_encoder``, which precomputed features leave out, are
dropped with a logged line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_mm.diffusers.predictor_wrapper import PredictorWrapper, map_fsdp2_paths
from lightning_mm.diffusers.wan_inputs import check_wan_inputs

__all__ = ["MINDSPEED_VACE_PREFIXES", "MINDSPEED_WAN_PATHS", "WanDiffusion", "mindspeed_fsdp2_config"]

MINDSPEED_WAN_PATHS: dict[str, str] = {"predictor.head": "predictor.proj_out"}
"""MindSpeed MM's Wan DiT module paths -> the diffusers ``WanTransformer3DModel`` ones (under ``predictor``)."""
MINDSPEED_VACE_PREFIXES: tuple[str, ...] = ("predictor.wan_dit.", "predictor.vace_dit.")
"""MindSpeed MM's VACE model's sub-model prefixes; diffusers' ``WanVACETransformer3DModel`` has both at its top."""


def _mapped_path(pattern: str) -> str:
    for prefix in MINDSPEED_VACE_PREFIXES:
        if pattern.startswith(prefix):
            pattern = "predictor." + pattern[len(prefix) :]
            break
    return MINDSPEED_WAN_PATHS.get(pattern, pattern)


class WanDiffusion(PredictorWrapper):
    """The Wan denoiser as ``predictor``, and its call on noisy latents."""

    def forward(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        encoder_hidden_states_image: Tensor | None = None,
        condition: Tensor | None = None,
        control: Tensor | None = None,
        control_scale: float = 1.0,
    ) -> Tensor:
        """The predicted velocity for ``hidden_states`` (noisy latents ``(B, C, F, H, W)``). Image-to-video models
        take the ``condition`` latents (mask and first-frame latents, concatenated on the channels, as diffusers'
        Wan i2v pipeline builds them) and the image embeddings ``encoder_hidden_states_image``. A VACE model
        (``WanVACETransformer3DModel``) takes the ``control`` latents (its ``control_hidden_states``) and
        ``control_scale``, the weight of each VACE block's hint (its ``control_hidden_states_scale``, the same
        for every block, as MindSpeed MM's ``vace_scale``). Inputs the predictor's config cannot take so are refused
        first (:func:`~.wan_inputs.check_wan_inputs`)."""
        check_wan_inputs(
            getattr(self.predictor, "config", None),
            hidden_states,
            encoder_hidden_states,
            encoder_hidden_states_image,
            condition,
        )
        if condition is not None:
            hidden_states = torch.cat([hidden_states, condition.to(hidden_states.dtype)], dim=1)
        extra: dict[str, Any] = {}
        if control is not None:
            layers = len(self.predictor.config.vace_layers)
            extra["control_hidden_states"] = control.to(hidden_states.dtype)
            extra["control_hidden_states_scale"] = torch.full(
                (layers,), float(control_scale), dtype=hidden_states.dtype, device=hidden_states.device
            )
        out = self.predictor(
            hidden_states=hidden_states,
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_image=encoder_hidden_states_image,
            return_dict=False,
            **extra,
        )
        return out[0]


def mindspeed_fsdp2_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A MindSpeed MM Wan ``fsdp2_config.yaml`` (a path, read safely, or its mapping) with its module paths
    mapped onto :class:`WanDiffusion` (see the module docstring). Other keys are kept as written."""
    return map_fsdp2_paths(config, _mapped_path, "WanDiffusion")
