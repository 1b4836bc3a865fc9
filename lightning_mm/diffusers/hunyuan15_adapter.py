"""diffusers' ``HunyuanVideo15Transformer3DModel`` with the FSDP2 hooks (imports ``diffusers``).

:class:`HunyuanVideo15Transformer3DModelFSDP`: its default plan makes each dual-stream transformer block
(``transformer_blocks.{*}``, MindSpeed MM's ``double_blocks``) an FSDP2 unit, and ``init_weights`` fills parameters
materialised from the meta device as the constructor does. Module paths and state-dict keys stay diffusers' own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from diffusers.models import HunyuanVideo15Transformer3DModel

from lightning_mm._utils.distributed import local_tensor
from lightning_mm.core.torch_init import init_like_constructors
from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin
from lightning_mm.hf.pending_weights import pending_pretrained

__all__ = ["HUNYUAN15_ADAPTERS", "HunyuanVideo15Transformer3DModelFSDP"]


# diffusers' own bases disagree on `config_name` (ModelMixin: str, ConfigMixin: None); not this class's doing.
class HunyuanVideo15Transformer3DModelFSDP(  # type: ignore[misc]
    HunyuanVideo15Transformer3DModel, FSDP2Mixin, WeightInitMixin
):
    """diffusers' ``HunyuanVideo15Transformer3DModel`` with a default sharding plan and meta-device initialisation."""

    hub_keys = ("HunyuanVideo15Transformer3DModel", "hunyuanvideo15")
    block_pattern = "transformer_blocks.{*}"
    """The module path pattern of the transformer blocks (the FSDP2 units and the recomputed modules)."""

    def default_fsdp2_config(self, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Each transformer block is a unit; the rest (embedders, token refiner, output) goes with the root."""
        return {"sub_modules_to_wrap": [self.block_pattern]}

    @torch.no_grad()
    def init_weights(self) -> None:
        """As the constructor (torch's ``reset_parameters()`` of each layer); zero-filled when pretrained weights
        follow."""
        if pending_pretrained(self) is not None:
            for tensor in self.parameters():
                local_tensor(tensor).zero_()
            return
        init_like_constructors(self)


HUNYUAN15_ADAPTERS: tuple[type, ...] = (HunyuanVideo15Transformer3DModelFSDP,)
