"""The check of a Wan denoiser's inputs against its config, before diffusers runs them.

A ``WanTransformer3DModel`` with an image embedder (``image_dim`` set: Wan 2.1 image-to-video) reads its
cross-attention context as the image tokens followed by the text's, and splits the two by position: diffusers'
``WanAttnProcessor`` takes the last 512 positions (the text encoder's context length, hard-coded) as the text, all
before them as the image. MindSpeed MM's ``WanDiT`` (``mindspeed_mm/models/predictor/dits/wan_dit.py``) splits at
``clip_token_len`` instead, and its features pad the text to ``text_len`` 512. Text embeddings of another length
would be split at the wrong position, and a batch without image embeddings would leave the image attention with no
tokens: both train without an error. Image embeddings for a model without an image embedder, and latent plus
condition channels other than the model's ``in_channels``, fail deep inside diffusers with a message that names
no batch key. :func:`check_wan_inputs` refuses each of these with a :class:`~lightning_mm.errors.DataError` naming
the batch keys and the model's config.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_mm.errors import DataError

__all__ = ["WAN_TEXT_CONTEXT", "check_wan_inputs"]

WAN_TEXT_CONTEXT = 512
"""The text length diffusers' Wan attention assumes when it splits image and text tokens (MindSpeed MM's
``text_len``)."""


def check_wan_inputs(
    config: Any, latents: Tensor, text: Tensor, image: Tensor | None = None, condition: Tensor | None = None
) -> None:
    """Refuse inputs that ``config`` (a ``WanTransformer3DModel`` config: ``in_channels``, ``image_dim``) cannot
    take as MindSpeed MM's Wan training means them: ``latents`` ``(B, C, F, H, W)`` and ``condition`` (the
    ``condition_latents`` concatenated to them on the channels), ``text`` ``(B, L, D)`` and ``image``
    ``(B, N, image_dim)``. A config without ``in_channels`` (another denoiser) is not checked."""
    in_channels = getattr(config, "in_channels", None)
    if not isinstance(in_channels, int):
        return
    image_dim = getattr(config, "image_dim", None)
    channels = int(latents.shape[1]) + (int(condition.shape[1]) if condition is not None else 0)
    if channels != in_channels:
        given = f"`latents` {latents.shape[1]}" + (
            f" + `condition_latents` {condition.shape[1]}" if condition is not None else " (no `condition_latents`)"
        )
        raise DataError(
            f"Wan batch: {given} = {channels} channels, but the model's in_channels is {in_channels}"
            + (
                " (an image-to-video model: give MindSpeed MM's i2v features, `i2v_vae_feature`)"
                if condition is None
                else " (give image-to-video features to an image-to-video checkpoint)"
            )
        )
    if image is not None and image_dim is None:
        raise DataError(
            "Wan batch: `image_embeds` (MindSpeed MM's `i2v_clip_feature`) given, but the model has no image "
            "embedder (its config's image_dim is null: a text-to-video checkpoint)"
        )
    if image is None and image_dim is not None:
        raise DataError(
            f"Wan batch: no `image_embeds`, but the model is image-to-video (image_dim {image_dim}): each sample "
            "needs MindSpeed MM's `i2v_clip_feature`"
        )
    if image is not None and int(text.shape[1]) != WAN_TEXT_CONTEXT:
        raise DataError(
            f"Wan batch: `prompt_embeds` has {text.shape[1]} positions; with `image_embeds` they must be "
            f"{WAN_TEXT_CONTEXT} (MindSpeed MM's text_len, the text padded to it), because diffusers' Wan attention "
            f"takes the last {WAN_TEXT_CONTEXT} positions as the text and the ones before as the image"
        )
