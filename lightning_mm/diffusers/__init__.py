"""Diffusers models (Wan 2.x video diffusion transformers) under the FSDP2 strategy: the hub, meta-device building
and sliced loading from a ``save_pretrained`` directory, the flow-matching schedule of MindSpeed MM's Wan recipe,
the model container the FSDP2 YAML's paths are relative to, and the export back to a diffusers directory.

Part of the Hugging Face layer (no Lightning). ``diffusers`` (the optional extra ``lightning-mm[diffusers]``) is
imported only when a diffusers model is built or resolved, never by ``import lightning_mm``.
"""

from lightning_mm.diffusers.diffusers_hub import DiffusersHub
from lightning_mm.diffusers.flow_matching import WanFlowMatchSchedule
from lightning_mm.diffusers.model import DiffusersModel, DiffusersModelConfig, DiffusersModelConfigError
from lightning_mm.diffusers.wan_diffusion import WanDiffusion

__all__ = [
    "DiffusersHub",
    "DiffusersModel",
    "DiffusersModelConfig",
    "DiffusersModelConfigError",
    "WanDiffusion",
    "WanFlowMatchSchedule",
]
