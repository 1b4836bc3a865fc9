"""The token count of a chat sample from its text and its images' sizes, without processing any image.

Token-budget batches plan with every sample's length. Where each image becomes ``grid_h * grid_w // merge_size**2``
image tokens (Transformers' Qwen2-VL and GLM-4V image processors, :data:`GRID_IMAGE_PROCESSORS`: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen2.5-Omni, GLM-4.1V, GLM-4.5V), the length is found as the sample is built,
with image token counts in place of the pixels:

1. each image's size (read from the file header by the caller) is bounded as the builder bounds the image, on a
   stand-in that only carries the size (:class:`SizeOnly`: the same resizes, PIL's error for an empty side);
2. the image processor's own public helper ``get_number_of_image_patches(height, width)``, with the processor's own
   settings (min/max pixels, patch and merge sizes: the builders pass it none), gives the patches the processor
   would make of that size (the same ``smart_resize``), hence the image's number of tokens;
3. the builder then makes the sample's token ids with those counts, by its own code:

   - MindSpeed MM's named templates (:class:`~lightning_mm.hf.mindspeed_samples.MindSpeedSampleBuilder`):
     ``tokens`` expands each ``<image>``, encodes each turn and cuts each (prompt, answer) pair with
     ``infer_seqlen`` to ``cutoff_len``, so the length is exact after the cut too;
   - the model's own chat template (:class:`~lightning_mm.hf.chat_samples.ChatSampleBuilder`, for the processors
     of :data:`COUNTING_PROCESSORS`, which expand the placeholder to the image tokens alone): the rendered text with
     the placeholders expanded is tokenized as the processor tokenizes it, labelled and cut at its end by the
     builder's ``finish``.

Videos (MindSpeed MM's Qwen-VL templates) likewise, no frame decoded (:func:`video_layout`): the container's frame
count, duration and size give the frames the decoder samples, bounded as the builder bounds a frame, then the video
processor's own frame sampling, resize and temporal padding give the grid (and the Qwen3-VL timestamps), and
``tokens`` expands each ``<video>`` from that layout. A stream that reports no frame count is built to be counted.

A record the builder refuses (a cut through an image's tokens, no trained token left, a side bounded to nothing)
gives ``None``, as any other family does: its sample is built to be counted (it fails there, is reported and
replaced). The token-budget loader checks each built sample against the length planned here, so a difference is
an error naming the sample, not a batch over its budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_mm.errors import DataError

__all__ = [
    "COUNTING_PROCESSORS",
    "GRID_IMAGE_PROCESSORS",
    "SizeOnly",
    "counts_lengths",
    "chat_sample_length",
    "image_token_count",
    "video_layout",
]

COUNTING_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Glm4vProcessor")
"""Processors whose image placeholder expands to ``image_token`` repeated ``grid.prod() // merge_size**2``
times and nothing else (their ``replace_image_token``): the own-chat-template path counts these."""

GRID_IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Glm4vImageProcessor")
"""Image processors (and their ``Pil`` / ``Fast`` variants) that make ``image_grid_thw`` of ``(1, grid_h, grid_w)``
per image, ``grid_h * grid_w`` being what their ``get_number_of_image_patches`` gives."""


class SizeOnly:
    """A stand-in for a PIL image that only has a size: what bounding an image needs (``width``, ``height``,
    ``size``, ``mode``, ``resize``, ``convert``), with no pixels decoded. ``resize`` refuses an empty side as PIL
    does."""

    mode = "RGB"

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = int(width), int(height)

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    def resize(self, size: Sequence[int], *args: Any, **kwargs: Any) -> SizeOnly:
        if size[0] <= 0 or size[1] <= 0:
            raise DataError("height and width must be > 0")  # PIL's Image.resize
        return SizeOnly(size[0], size[1])

    def convert(self, *args: Any, **kwargs: Any) -> SizeOnly:
        return self


def _grid_image_processor(image_processor: Any) -> bool:
    name = type(image_processor).__name__.removesuffix("Fast").removesuffix("Pil")
    return (
        name in GRID_IMAGE_PROCESSORS
        and callable(getattr(image_processor, "get_number_of_image_patches", None))
        and isinstance(getattr(image_processor, "merge_size", None), int)
        and getattr(image_processor, "do_resize", True) is not False
    )


def counts_lengths(builder: Any) -> bool:
    """Whether the samples of ``builder`` can be counted without their images (see the module docstring)."""
    from lightning_mm.hf.chat_samples import ChatSampleBuilder
    from lightning_mm.hf.mindspeed_samples import MindSpeedSampleBuilder

    processor = getattr(builder, "processor", None)
    if not _grid_image_processor(getattr(processor, "image_processor", None)):
        return False
    if isinstance(builder, MindSpeedSampleBuilder):
        return True
    return (
        isinstance(builder, ChatSampleBuilder)
        and type(processor).__name__ in COUNTING_PROCESSORS
        and isinstance(getattr(processor, "image_token", None), str)
    )


def image_token_count(builder: Any, width: int, height: int) -> int:
    """The image tokens of an image of ``width`` x ``height`` pixels in a sample of ``builder``: bounded as the
    builder bounds it, then as the image processor's own settings resize it."""
    bounded = builder.bound_image(SizeOnly(width, height))
    image_processor = builder.processor.image_processor
    patches = image_processor.get_number_of_image_patches(bounded.height, bounded.width, {})
    return int(patches) // int(image_processor.merge_size) ** 2


def video_layout(builder: Any, path: Any) -> Any:
    """The :class:`~lightning_mm.hf.mindspeed_samples.VideoLayout` that
    :meth:`~lightning_mm.hf.mindspeed_samples.MindSpeedSampleBuilder.video_inputs` gives the video at ``path``,
    no frame decoded: the frame count and size from the container's metadata (the same sampling as the decoder,
    :func:`~lightning_mm.hf.video_frames.sampled_frames`), each frame bounded as the builder bounds it (on a
    :class:`SizeOnly`), then the video processor's own frame sampling, resize and grid, and the timestamps of the
    frames it keeps. ``ValueError`` where the builder takes no videos or the stream reports no frame count."""
    from lightning_mm.hf.video_frames import sampled_frames

    t = builder.template
    processor = builder.video_processor
    if t.video is None or processor is None:
        raise DataError("the builder takes no videos")
    count, width, height = sampled_frames(path, builder.video_fps, builder.video_maxlen)
    bounded = builder.bound_frame(SizeOnly(width, height))
    kept = processor.kept_frames(count, builder.metadata_fps)
    return builder.video_layout(processor.grid(len(kept), bounded.height, bounded.width), kept)


def chat_sample_length(
    builder: Any,
    messages: Sequence[dict[str, str]],
    system: str | None,
    image_sizes: Sequence[tuple[int, int]],
    videos: Sequence[Any] = (),
) -> int | None:
    """The length of ``builder(messages, system, images, videos)`` for images of ``image_sizes`` (``(width,
    height)``, as PIL gives them) and the video files ``videos`` (:func:`video_layout`), or ``None`` when it cannot
    be counted without the images and videos or the builder refuses the record (then build the sample)."""
    from lightning_mm.hf.chat_samples import SampleError
    from lightning_mm.hf.mindspeed_samples import MindSpeedSampleBuilder

    if not counts_lengths(builder):
        return None
    try:
        counts = [image_token_count(builder, width, height) for width, height in image_sizes]
        if isinstance(builder, MindSpeedSampleBuilder):
            layouts = [video_layout(builder, path) for path in videos]
            return len(builder.tokens(messages, system, counts, layouts)[0])
        if videos:
            return None  # the model's own chat template takes no videos here: building the record says so
        return _own_template_length(builder, messages, system, counts)
    except (SampleError, ValueError):  # the builder refuses the record, or the processor its image or video size
        return None


def _own_template_length(
    builder: Any, messages: Sequence[dict[str, str]], system: str | None, counts: list[int]
) -> int | None:
    """A :class:`~lightning_mm.hf.chat_samples.ChatSampleBuilder` sample's length: its rendered text with each
    placeholder expanded to its image tokens (as the processor's ``replace_image_token`` does), tokenized as the
    processor tokenizes it, then labelled and cut by the builder's own ``finish``."""
    import torch

    conv, untrained_prefix = builder.conversation(messages, system)
    text, spans = builder.trained_spans(conv, untrained_prefix)
    token = builder.processor.image_token
    pieces = text.split(token)
    if len(pieces) != len(counts) + 1:
        return None  # the builder refuses such a record; building it says why
    expanded, replacements, cursor = pieces[0], [], len(pieces[0])
    for count, piece in zip(counts, pieces[1:]):
        new = token * count
        replacements.append(
            {"span": (cursor, cursor + len(token)), "new_span": (len(expanded), len(expanded) + len(new))}
        )
        expanded += new + piece
        cursor += len(token) + len(piece)
    bos = builder.tokenizer.bos_token
    add_special = not (bos is not None and text.startswith(bos))
    encoded = builder.tokenizer(expanded, add_special_tokens=add_special, return_offsets_mapping=True)
    sample = {"input_ids": torch.tensor(encoded["input_ids"], dtype=torch.long)}
    offsets = [tuple(o) for o in encoded["offset_mapping"]]
    return len(builder.finish(sample, spans, offsets, replacements)["input_ids"])
