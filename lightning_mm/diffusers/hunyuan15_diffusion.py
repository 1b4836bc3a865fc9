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

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_mm.diffusers.predictor_wrapper import PredictorWrapper, map_fsdp2_paths

__all__ = ["MINDSPEED_HUNYUAN15_PATHS", "T2V_IMAGE_TOKENS", "Hunyuan15Diffusion", "mindspeed_hunyuan15_fsdp2_config"]

MINDSPEED_HUNYUAN15_PATHS: dict[str, str] = {
    "predictor.double_blocks.{*}": "predictor.transformer_blocks.{*}",
    "predictor.double_blocks": "predictor.transformer_blocks",
}
"""MindSpeed MM's HunyuanVideo 1.5 DiT module paths -> the diffusers ones (under ``predictor``)."""


def _mapped_path(pattern: str) -> str:
    return MINDSPEED_HUNYUAN15_PATHS.get(pattern, pattern)


T2V_IMAGE_TOKENS = 729
"""The zero image tokens of a text-to-video call (``HunyuanVideo15Pipeline.vision_num_semantic_tokens``)."""


class Hunyuan15Diffusion(PredictorWrapper):
    """The HunyuanVideo 1.5 denoiser as ``predictor``, and its training call."""

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
    return map_fsdp2_paths(config, _mapped_path, "Hunyuan15Diffusion")
