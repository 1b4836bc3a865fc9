"""``Hunyuan15Diffusion``: the module MindSpeed MM's HunyuanVideo 1.5 FSDP2 YAML is written against
(``predictor.double_blocks.{*}``), holding diffusers' ``HunyuanVideo15Transformer3DModel`` as ``predictor``.

Its call is the training call of MindSpeed MM's ``HunyuanVideo15DiT`` (``mindspeed_mm/models/predictor/dits/
hunyuan_video_15_dit.py``): the noisy latents ``(B, C, F, H, W)`` get ``C + 1`` condition channels before the patch
embedding (image-to-video: the first frame's latents and its mask, MindSpeed MM's ``cond_latents``; text-to-video:
zeros), the MLLM text states go through the token refiner with their mask, the byT5 glyph states
(``encoder_hidden_states_2``) through the byT5 projection, and image-to-video's SigLIP states (``image_embeds``,
MindSpeed MM's ``vision_states``) through the image projection. diffusers' model always takes image tokens: for
text-to-video they are zeros (729 SigLIP tokens), which the model masks out, as its ``HunyuanVideo15Pipeline`` does
and as MindSpeed MM's t2v DiT, which has no image projection, leaves them out.

:func:`mindspeed_hunyuan15_fsdp2_config` reads MindSpeed MM's ``examples/hunyuanvideo_1.5/fsdp2_config.yaml`` as
written and maps its module paths: MindSpeed MM's ``predictor.double_blocks`` are diffusers'
``predictor.transformer_blocks``; ``ignored_modules`` naming ``ae`` / ``text_encoder`` (the frozen encoders,
absent with precomputed features) are dropped with a logged line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mm.hf.mixins import FSDP2Mixin

__all__ = ["MINDSPEED_HUNYUAN15_PATHS", "T2V_IMAGE_TOKENS", "Hunyuan15Diffusion", "mindspeed_hunyuan15_fsdp2_config"]

log = logging.getLogger(__name__)

MINDSPEED_HUNYUAN15_PATHS: dict[str, str] = {
    "predictor.double_blocks.{*}": "predictor.transformer_blocks.{*}",
    "predictor.double_blocks": "predictor.transformer_blocks",
}
"""MindSpeed MM's HunyuanVideo 1.5 DiT module paths -> the diffusers ones (under ``predictor``)."""

T2V_IMAGE_TOKENS = 729
"""The zero image tokens of a text-to-video call (``HunyuanVideo15Pipeline.vision_num_semantic_tokens``)."""

_PATH_KEYS = ("sub_modules_to_wrap", "recompute_modules", "ignored_modules")
_ABSENT_COMPONENTS = ("ae", "text_encoder")


class Hunyuan15Diffusion(nn.Module, FSDP2Mixin):
    """The HunyuanVideo 1.5 denoiser as ``predictor``, and its training call."""

    def __init__(self, predictor: nn.Module) -> None:
        super().__init__()
        # An adapted diffusers model: its init_weights / load_after_sharding / default_fsdp2_config are called by name.
        self.predictor: Any = predictor

    def default_fsdp2_config(self, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The predictor's defaults, with paths under ``predictor``."""
        inner = self.predictor.default_fsdp2_config(explicit) if hasattr(self.predictor, "default_fsdp2_config") else {}
        return {k: [f"predictor.{p}" for p in v] if k in _PATH_KEYS else v for k, v in inner.items()}

    @torch.no_grad()
    def init_weights(self) -> None:
        self.predictor.init_weights()

    def load_after_sharding(self) -> None:
        self.predictor.load_after_sharding()

    def forward(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        encoder_attention_mask: Tensor,
        encoder_hidden_states_2: Tensor,
        encoder_attention_mask_2: Tensor,
        condition: Tensor | None = None,
        image_embeds: Tensor | None = None,
    ) -> Tensor:
        """The predicted velocity for the noisy latents ``hidden_states`` (text-to-video without ``condition`` and
        ``image_embeds``)."""
        b, c, f, h, w = hidden_states.shape
        if condition is None:
            condition = torch.zeros((b, c + 1, f, h, w), device=hidden_states.device, dtype=hidden_states.dtype)
        image = image_embeds
        if image is None:
            image = torch.zeros(
                (b, T2V_IMAGE_TOKENS, int(self.predictor.config.image_embed_dim)),
                device=hidden_states.device,
                dtype=encoder_hidden_states.dtype,
            )
        out = self.predictor(
            hidden_states=torch.cat([hidden_states, condition.to(hidden_states.dtype)], dim=1),
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            encoder_hidden_states_2=encoder_hidden_states_2,
            encoder_attention_mask_2=encoder_attention_mask_2,
            image_embeds=image,
            return_dict=False,
        )
        return out[0]


def mindspeed_hunyuan15_fsdp2_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """MindSpeed MM's HunyuanVideo 1.5 ``fsdp2_config.yaml`` (a path, read safely, or its mapping) with its module
    paths mapped onto :class:`Hunyuan15Diffusion` (see the module docstring). Other keys are kept as written."""
    from lightning_mm._utils.yaml_io import load_mapping

    raw = load_mapping(config) if isinstance(config, (str, os.PathLike)) else dict(config)
    out = dict(raw)
    for key in _PATH_KEYS:
        value = raw.get(key)
        if not isinstance(value, list):
            continue
        mapped = []
        for pattern in value:
            if key == "ignored_modules" and pattern in _ABSENT_COMPONENTS:
                log.info("fsdp2_config `ignored_modules`: '%s' is not part of Hunyuan15Diffusion: dropped", pattern)
                continue
            new = MINDSPEED_HUNYUAN15_PATHS.get(pattern, pattern) if isinstance(pattern, str) else pattern
            if new != pattern:
                log.info("fsdp2_config `%s`: MindSpeed MM's '%s' is diffusers' '%s'", key, pattern, new)
            mapped.append(new)
        out[key] = mapped
    return out
