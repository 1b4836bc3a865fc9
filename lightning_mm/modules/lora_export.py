"""LoRA export: the public face of :mod:`lightning_mm.hf.lora_export` (kept where docs/hf-models.md names it)."""

from lightning_mm.hf.lora_export import *  # noqa: F403
from lightning_mm.hf.lora_export import __all__  # noqa: F401
