"""A vision-language model's own Hugging Face processor, loaded from a local model directory.

``AutoProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=False)`` is tried first. Transformers
5's Qwen-VL processors also load a video processor, and those need torchvision; where torchvision is missing the
whole load fails, images included. Then the processor class the directory names (``processor_class`` in
``processor_config.json`` or ``preprocessor_config.json``; it must be one of Transformers' own processor classes,
never code from the directory) is built from its tokenizer (``AutoTokenizer``), its image processor
(``AutoImageProcessor``, which falls back to Transformers' PIL implementation) and its chat template, without a
video processor. This is logged; videos are then processed by :mod:`lightning_mm.hf.qwen_video` for the Qwen-VL
families with MindSpeed MM's templates, and refused otherwise (:attr:`LoadedProcessor.video_note`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mm.errors import ConfigError

__all__ = ["LoadedProcessor", "load_vlm_processor", "ProcessorLoadError"]

log = logging.getLogger(__name__)


class ProcessorLoadError(ConfigError):
    """The model directory holds no usable processor."""


@dataclass
class LoadedProcessor:
    processor: Any
    video_note: str | None
    """Why videos cannot be processed (``None`` when the processor has a video processor)."""


def _processor_class_name(path: Path) -> str | None:
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = path / name
        if file.is_file() and file.stat().st_size < (1 << 20):
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(data, dict) and isinstance(data.get("processor_class"), str):
                return data["processor_class"]
    return None


def _chat_template(path: Path, tokenizer: Any) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    file = path / "chat_template.json"
    if file.is_file():
        data = json.loads(file.read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
            return data["chat_template"]
    return getattr(tokenizer, "chat_template", None)


def _without_video(path: Path, why: str) -> Any:
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer, ProcessorMixin

    name = _processor_class_name(path)
    base = getattr(transformers, name, None) if name else None
    if base is not None and not (isinstance(base, type) and issubclass(base, ProcessorMixin)):
        # Transformers' stand-in for a class whose module needs a missing backend (Mistral 3's PixtralProcessor)
        raise ProcessorLoadError(
            f"{path}: Transformers' {name} cannot be used without torchvision, which is not "
            "installed (its own module needs it, not only a video processor)"
        )
    if not (isinstance(base, type) and issubclass(base, ProcessorMixin)):
        raise ProcessorLoadError(
            f"{path}: the processor cannot be loaded ({why}) and the directory names no "
            f"Transformers processor class to build without a video processor (got {name!r})"
        )

    class _ImagesOnly(base):  # type: ignore[misc, valid-type]
        """The processor without its video processor (``video_processor`` is ``None``)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def __reduce__(self) -> tuple[Any, tuple[str]]:  # a DataLoader worker started by spawn loads it again
            return _reload, (str(path),)

    _ImagesOnly.__name__ = _ImagesOnly.__qualname__ = base.__name__
    kwargs = {"local_files_only": True, "trust_remote_code": False}
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    parts = {
        "image_processor": AutoImageProcessor.from_pretrained(str(path), **kwargs),
        "tokenizer": tokenizer,
        "video_processor": None,
    }
    if "feature_extractor" in base.get_attributes():  # an omni-modal processor (Qwen2.5-Omni): its audio part
        from transformers import AutoFeatureExtractor

        parts["feature_extractor"] = AutoFeatureExtractor.from_pretrained(str(path), **kwargs)
    return _ImagesOnly(**parts, chat_template=_chat_template(path, tokenizer))


def _reload(path: str) -> Any:
    return load_vlm_processor(path).processor


def load_vlm_processor(path: str | Path) -> LoadedProcessor:
    """The processor of the model in ``path`` (a local directory; never the Hub, never remote code)."""
    from transformers import AutoProcessor

    path = Path(path)
    try:
        processor = AutoProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ImportError, ValueError) as err:
        # A missing torchvision is an ImportError, or a ValueError where the directory has a video processor
        # config (video_preprocessor_config.json: AutoVideoProcessor "requires `torchvision`").
        if "torchvision" not in str(err).lower():
            raise ProcessorLoadError(f"{path}: cannot load the processor: {str(err).strip()[:300]}") from err
        why = "its video processor needs torchvision, which is not installed"
        processor = _without_video(path, why)
        log.info(
            "%s: %s; loaded %s without a video processor (videos: lightning_mm.hf.qwen_video)",
            path,
            why,
            type(processor).__name__,
        )
        return LoadedProcessor(processor, "the model's video processor needs torchvision, which is not installed")
    except OSError as err:
        raise ProcessorLoadError(f"{path}: cannot load the processor: {str(err).strip()[:300]}") from err
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise ProcessorLoadError(
            f"{path}: {type(processor).__name__} is not a vision-language processor "
            "(it has no image processor and tokenizer)"
        )
    note = None if getattr(processor, "video_processor", None) is not None else "the model has no video processor"
    return LoadedProcessor(processor, note)
