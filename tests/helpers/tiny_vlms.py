"""Tiny random VLM directories for the tests: the builder the examples' stand-ins use (``examples/tiny_vlms.py``)."""

from examples.tiny_vlms import (  # noqa: F401
    FAMILIES,
    LLAVA_CHAT_TEMPLATE,
    QWEN2_5_VL_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    write_tiny_vlm,
)

__all__ = ["FAMILIES", "LLAVA_CHAT_TEMPLATE", "QWEN2_5_VL_CHAT_TEMPLATE", "QWEN3_VL_CHAT_TEMPLATE", "write_tiny_vlm"]
