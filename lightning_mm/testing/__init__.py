"""Tiny random models, saved as a Hub checkpoint lays them out: the one set of builders the examples and the tests
share (no network; every model, tokenizer and processor is generated locally with Transformers' own classes).

* :func:`~lightning_mm.testing.tiny_vlms.write_tiny_vlm`: Qwen2.5-VL, Qwen3-VL and LLaVA-1.5 directories;
* :func:`~lightning_mm.testing.tiny_families.write_tiny_family`: Gemma 3, Idefics3, Mistral 3, GLM-4.1V/4.5V and
  Qwen2.5-Omni's thinker;
* :func:`~lightning_mm.testing.tiny_internvl.build_tiny_internvl`: InternVL in Transformers' format;
* :func:`~lightning_mm.testing.tiny_qwen3_5.tiny_qwen3_5_moe`: Qwen3.5-MoE.

Nothing in the package imports this sub-package; it needs ``tokenizers`` (a dependency of Transformers).
"""

from lightning_mm.testing.tiny_families import write_tiny_family
from lightning_mm.testing.tiny_internvl import build_tiny_internvl
from lightning_mm.testing.tiny_qwen3_5 import tiny_qwen3_5_moe
from lightning_mm.testing.tiny_vlms import write_tiny_vlm

__all__ = ["build_tiny_internvl", "tiny_qwen3_5_moe", "write_tiny_family", "write_tiny_vlm"]
