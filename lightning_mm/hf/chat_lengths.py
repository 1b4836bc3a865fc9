"""The token count of a chat sample from its text and its images' sizes, without processing any image.

Token-budget batches plan with every sample's length. For the processors that expand each image placeholder into
``image_token * (grid_t * grid_h * grid_w) / merge_size**2`` (:data:`COUNTING_PROCESSORS`: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and the families that take Qwen3-VL's processor, GLM-4.1V and GLM-4.5V), the length is found as the
sample is built, without the pixels:

1. the conversation is rendered by the :class:`~lightning_mm.hf.chat_samples.ChatSampleBuilder` (its chat template);
2. each image's size (read from the file header by the caller) is bounded as the builder bounds the image, on a
   stand-in that only carries the size (:class:`SizeOnly`), and the image processor's own public helper
   ``get_number_of_image_patches(height, width, images_kwargs)`` (with the builder's pixel bounds) gives its patch
   count, hence its number of image tokens;
3. each placeholder of the rendered text is expanded to that many image tokens and the text is tokenized as the
   processor tokenizes it; a ``cutoff_len`` caps the count, as the builder cuts the sample.

Other processors (their expansion adds text around the image tokens) return ``None`` from :func:`counts_lengths`
and their samples are built to be counted. The token-budget loader checks each built sample against the length
planned here, so a difference is an error naming the sample, not a batch over its budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["COUNTING_PROCESSORS", "SizeOnly", "counts_lengths", "chat_sample_length", "image_token_count"]

COUNTING_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Glm4vProcessor")
"""Processors whose image placeholder expands to ``image_token`` repeated ``grid.prod() // merge_size**2``
times (their ``replace_image_token``)."""


class SizeOnly:
    """A stand-in for a PIL image that only has a size: what bounding an image needs (``width``, ``height``,
    ``size``, ``mode``, ``resize``, ``convert``), with no pixels decoded."""

    mode = "RGB"

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = int(width), int(height)

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    def resize(self, size: Sequence[int], *args: Any, **kwargs: Any) -> SizeOnly:
        return SizeOnly(size[0], size[1])

    def convert(self, *args: Any, **kwargs: Any) -> SizeOnly:
        return self


def counts_lengths(builder: Any) -> bool:
    """Whether the samples of ``builder`` can be counted without their images (see the module docstring)."""
    processor = getattr(builder, "processor", None)
    image_processor = getattr(processor, "image_processor", None)
    return (
        type(processor).__name__ in COUNTING_PROCESSORS
        and callable(getattr(image_processor, "get_number_of_image_patches", None))
        and isinstance(getattr(image_processor, "merge_size", None), int)
        and isinstance(getattr(processor, "image_token", None), str)
    )


def _images_kwargs(builder: Any) -> dict[str, Any]:
    """The builder's image-processor settings, its ``size`` pixel bounds also under the names Qwen-VL's patch-count
    helper reads first (``min_pixels`` / ``max_pixels``; GLM-4V's reads ``size``)."""
    kwargs = dict(getattr(builder, "images_kwargs", None) or {})
    size = kwargs.get("size")
    if isinstance(size, dict):
        if "shortest_edge" in size:
            kwargs["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            kwargs["max_pixels"] = size["longest_edge"]
    return kwargs


def image_token_count(builder: Any, width: int, height: int) -> int:
    """The image tokens of an image of ``width`` x ``height`` pixels in a sample of ``builder``."""
    bounded = builder.bound_image(SizeOnly(width, height))
    image_processor = builder.processor.image_processor
    patches = image_processor.get_number_of_image_patches(bounded.height, bounded.width, _images_kwargs(builder))
    return int(patches) // int(image_processor.merge_size) ** 2


def chat_sample_length(
    builder: Any, messages: Sequence[dict[str, str]], system: str | None, image_sizes: Sequence[tuple[int, int]]
) -> int | None:
    """The length of ``builder(messages, system, images)`` for images of ``image_sizes`` (``(width, height)``, as
    PIL gives them), or ``None`` when it cannot be counted without the images (then build the sample)."""
    if not counts_lengths(builder):
        return None
    conv, _ = builder.conversation(messages, system)
    text = builder._render(conv)
    token = builder.processor.image_token
    pieces = text.split(token)
    if len(pieces) != len(image_sizes) + 1:
        return None  # the builder refuses such a record; building it says why
    expanded = pieces[0]
    for (width, height), piece in zip(image_sizes, pieces[1:]):
        expanded += token * image_token_count(builder, width, height) + piece
    tokenizer = builder.tokenizer
    bos = tokenizer.bos_token
    add_special = not (bos is not None and text.startswith(bos))
    length = len(tokenizer(expanded, add_special_tokens=add_special)["input_ids"])
    cutoff = getattr(builder, "cutoff_len", None)
    return min(length, cutoff) if cutoff is not None else length
