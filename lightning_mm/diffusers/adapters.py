"""The built-in diffusers adapters: diffusers model classes with the FSDP2 hooks (imports ``diffusers``).

``WanTransformer3DModel`` (Wan 2.1 / 2.2, text-to-video and image-to-video: the i2v variants differ only in their
config: ``in_channels`` 36, ``image_dim``, ``added_kv_proj_dim``) becomes :class:`WanTransformer3DModelFSDP`: its
default plan makes each transformer block (``blocks.{*}``) an FSDP2 unit, and ``init_weights`` fills parameters
materialised from the meta device as the constructor does. ``WanVACETransformer3DModel`` (Wan VACE: the Wan blocks
plus the VACE control branch, ``vace_patch_embedding`` and ``vace_blocks``) becomes
:class:`WanVACETransformer3DModelFSDP` the same way, with the VACE blocks as units too. Module paths and state-dict
keys stay diffusers' own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# diffusers.models, not diffusers: the top-level package's type-checking imports give its no-torch placeholder.
from diffusers.models import WanTransformer3DModel, WanVACETransformer3DModel
from torch import nn

from lightning_mm._utils.distributed import local_tensor
from lightning_mm.core.torch_init import init_like_constructors
from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin
from lightning_mm.hf.pending_weights import pending_pretrained

__all__ = ["BUILTIN_ADAPTERS", "WanTransformer3DModelFSDP", "WanVACETransformer3DModelFSDP"]


# diffusers' own bases disagree on `config_name` (ModelMixin: str, ConfigMixin: None); not this class's doing.
class WanTransformer3DModelFSDP(WanTransformer3DModel, FSDP2Mixin, WeightInitMixin):  # type: ignore[misc]
    """diffusers' ``WanTransformer3DModel`` with a default sharding plan and meta-device initialisation."""

    hub_keys = ("WanTransformer3DModel", "wan")
    block_pattern = "blocks.{*}"
    """The module path pattern of the transformer blocks (the FSDP2 units and the recomputed modules)."""

    def default_fsdp2_config(self, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Each transformer block is a unit; the rest (embeddings, output projection) goes with the root."""
        return {"sub_modules_to_wrap": [self.block_pattern]}

    @torch.no_grad()
    def init_weights(self) -> None:
        """As the constructor: torch's ``reset_parameters()`` of each layer, the modulation tables
        (``scale_shift_table``) ~ N(0, 1/dim), the image position embedding (FLF2V's ``pos_embed``) zero.
        Zero-filled instead when pretrained weights follow."""
        _init_wan_weights(self)


def _init_wan_weights(model: nn.Module) -> None:
    if pending_pretrained(model) is not None:
        for tensor in model.parameters():
            local_tensor(tensor).zero_()
        return
    init_like_constructors(model)
    for module in model.modules():
        table = getattr(module, "scale_shift_table", None)
        if isinstance(table, nn.Parameter):
            nn.init.normal_(table, std=table.shape[-1] ** -0.5)
        position = getattr(module, "pos_embed", None)
        if isinstance(position, nn.Parameter):
            nn.init.zeros_(position)


class WanVACETransformer3DModelFSDP(WanVACETransformer3DModel, FSDP2Mixin, WeightInitMixin):  # type: ignore[misc]
    """diffusers' ``WanVACETransformer3DModel`` with a default sharding plan and meta-device initialisation."""

    hub_keys = ("WanVACETransformer3DModel", "wan_vace")
    block_pattern = "blocks.{*}"
    vace_block_pattern = "vace_blocks.{*}"
    """The module path patterns of the Wan blocks and of the VACE blocks (the FSDP2 units)."""

    def default_fsdp2_config(self, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Each Wan block and each VACE block is a unit; the rest goes with the root."""
        return {"sub_modules_to_wrap": [self.block_pattern, self.vace_block_pattern]}

    @torch.no_grad()
    def init_weights(self) -> None:
        """As :meth:`WanTransformer3DModelFSDP.init_weights` (the VACE blocks have modulation tables too)."""
        _init_wan_weights(self)


BUILTIN_ADAPTERS: tuple[type, ...] = (WanTransformer3DModelFSDP, WanVACETransformer3DModelFSDP)
