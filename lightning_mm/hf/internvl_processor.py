"""InternVL's Hugging Face processor for images and text, loaded from a local model directory.

Transformers' ``InternVLProcessor`` also holds a video processor, and in Transformers 5 a processor with a video
processor cannot be built without torchvision (``AutoProcessor.from_pretrained`` fails on the video processor, and
so does ``InternVLProcessor(...)`` even with ``video_processor=None``). :class:`InternVLImageTextProcessor` is
``InternVLProcessor`` without that attribute: the same ``__call__``, ``apply_chat_template`` and placeholder
expansion (``<IMG_CONTEXT>`` -> ``<img>`` + ``<IMG_CONTEXT>`` * ``image_seq_length`` * tiles + ``</img>``), built
from the directory's tokenizer, image processor and ``processor_config.json``. The image processor is loaded with
the PIL backend (``GotOcr2ImageProcessorPil``) on every machine: MindSpeed MM tiles images with PIL, and the
torchvision backend resizes differently. No Lightning here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from transformers import AutoImageProcessor, AutoTokenizer, GotOcr2ImageProcessorPil, InternVLProcessor
from transformers.processing_utils import ProcessorMixin

from lightning_mm.errors import ConfigError

__all__ = ["InternVLImageTextProcessor", "load_internvl_processor", "ProcessorDirectoryError"]

_MAX_CONFIG_BYTES = 1 << 20


class ProcessorDirectoryError(ConfigError):
    """A model directory whose processor files cannot be used (the message names the file)."""


class InternVLImageTextProcessor(InternVLProcessor):
    """``transformers.InternVLProcessor`` for images and text (no video processor, so no torchvision needed)."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        image_seq_length: int = 256,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        # InternVLProcessor.__init__ passes a video processor on to ProcessorMixin; this class has none.
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)
        self.image_seq_length = image_seq_length
        self.start_image_token = tokenizer.start_image_token
        self.end_image_token = tokenizer.end_image_token
        self.start_image_token_id = tokenizer.start_image_token_id
        self.end_image_token_id = tokenizer.end_image_token_id
        self.image_token = tokenizer.context_image_token
        self.video_token = tokenizer.video_token
        self.image_token_id = tokenizer.context_image_token_id
        self.multimodal_pattern = re.compile(
            f"(?P<image>{re.escape(self.image_token)})|(?P<video>{re.escape(self.video_token)})"
        )


def _read_json(path: Path) -> dict[str, Any]:
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ProcessorDirectoryError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ProcessorDirectoryError(f"{path}: not a JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ProcessorDirectoryError(f"{path}: expected a JSON object")
    return data


def load_internvl_processor(directory: str | Path) -> InternVLImageTextProcessor:
    """InternVL's processor from a local model directory (no hub, no remote code, PIL image backend).

    The directory holds what ``InternVLProcessor.save_pretrained`` writes: ``processor_config.json`` (with
    ``processor_class: InternVLProcessor`` and ``image_seq_length``), ``preprocessor_config.json`` (a GotOCR2
    image processor), the tokenizer files with InternVL's named tokens (``start_image_token``,
    ``end_image_token``, ``context_image_token``, ``video_token``) and the chat template.
    """
    directory = Path(directory)
    config_file = directory / "processor_config.json"
    if not config_file.is_file():
        raise ProcessorDirectoryError(f"{config_file}: not found (InternVL's processor files are needed)")
    config = _read_json(config_file)
    if config.get("processor_class") != "InternVLProcessor":
        raise ProcessorDirectoryError(
            f"{config_file}: processor_class is {config.get('processor_class')!r}, expected 'InternVLProcessor' "
            "(Transformers' InternVL format)"
        )
    seq = config.get("image_seq_length", 256)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise ProcessorDirectoryError(f"{config_file}: image_seq_length must be a positive integer, got {seq!r}")
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    for name in ("start_image_token", "end_image_token", "context_image_token", "video_token"):
        token = getattr(tokenizer, name, None)
        if not isinstance(token, str) or tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
            raise ProcessorDirectoryError(
                f"{directory}: the tokenizer has no `{name}` token (InternVL's tokenizer config names "
                "start_image_token, end_image_token, context_image_token and video_token)"
            )
    image_processor = AutoImageProcessor.from_pretrained(
        str(directory), local_files_only=True, trust_remote_code=False, backend="pil"
    )
    if not isinstance(image_processor, GotOcr2ImageProcessorPil):
        raise ProcessorDirectoryError(
            f"{directory}: the image processor is {type(image_processor).__name__}, expected InternVL's "
            "GotOcr2ImageProcessor (dynamic tiling)"
        )
    kwargs: dict[str, Any] = {"image_seq_length": seq}
    template = getattr(tokenizer, "chat_template", None)
    for name in ("chat_template.jinja", "chat_template.json"):
        file = directory / name
        if file.is_file():
            template = (
                file.read_text(encoding="utf-8") if name.endswith(".jinja") else _read_json(file).get("chat_template")
            )
            break
    if isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    return InternVLImageTextProcessor(image_processor, tokenizer, chat_template=template, **kwargs)
