"""LoRA: the public face of :mod:`lightning_mm.hf.lora` (kept where docs/hf-models.md names it)."""

from lightning_mm.hf.lora import *  # noqa: F403
from lightning_mm.hf.lora import __all__  # noqa: F401
