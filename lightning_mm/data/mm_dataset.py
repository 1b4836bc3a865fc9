"""The native multimodal dataset and its collate function (``build_mm_dataset`` / ``build_mm_dataloader``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from lightning_mm.data.data_config import DataConfigError, PreprocessConfig
from lightning_mm.data.record_files import DataReport, Record
from lightning_mm.data.replacing import ReplacingDataset
from lightning_mm.errors import ConfigError

__all__ = ["MMDataset", "MMCollator", "load_tokenizer", "load_processor"]

IGNORE_INDEX = -100


def load_tokenizer(path: Any) -> Any:
    """A Hugging Face tokenizer from a local directory (never the hub, never remote code)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"the tokenizer in {path} has no pad token; set `pad_token` in its tokenizer config")
    return tokenizer


def load_processor(path: Any) -> Any:
    """A Hugging Face image processor from a local directory."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    _check_processor_normalisation(processor, path)
    return processor


def _check_processor_normalisation(processor: Any, path: Any) -> None:
    """A processor that normalises with a zero or non-finite std (or a non-finite mean) makes every image NaN."""
    if not getattr(processor, "do_normalize", True):
        return
    for key in ("image_mean", "image_std"):
        values = getattr(processor, key, None)
        if values is None:
            continue
        values = [values] if isinstance(values, (int, float)) else list(values)
        try:
            bad = [float(v) for v in values if not math.isfinite(float(v)) or (key == "image_std" and float(v) == 0)]
        except (TypeError, ValueError):
            bad = values
        if bad:
            raise DataConfigError(
                f"{path}: image processor `{key}` is {values}: every image would be NaN or "
                "infinite after normalisation (a std must be finite and non-zero)"
            )


class MMDataset(ReplacingDataset):
    """Checked records turned into ``{image_key: CxHxW float tensor, input_ids, labels}`` samples.

    An image that passed the up-front check (``PIL.Image.verify``, headers and checksums) can still fail to
    decode (a corrupt pixel stream): then the next record whose image decodes takes its place, counted and warned
    about (:mod:`lightning_mm.data.replacing`), or a :class:`DataError` naming the record in strict mode.
    """

    failed_in_a_row = "images in a row failed to decode"
    nothing_readable = "no record has an image that decodes"
    broken = "the data or the image processor is broken"

    def __init__(
        self,
        records: list[Record],
        preprocess: PreprocessConfig,
        processor: Any = None,
        strict: bool = False,
        report: DataReport | None = None,
    ) -> None:
        super().__init__(records, report, strict)
        self.pre = preprocess
        self.processor = processor
        self._mean = torch.tensor(preprocess.image_mean).view(3, 1, 1)
        self._std = torch.tensor(preprocess.image_std).view(3, 1, 1)

    def _image(self, record: Record) -> torch.Tensor:
        with Image.open(record.image) as img:
            img = img.convert("RGB")
            if self.processor is not None:
                return self.processor(images=img, return_tensors="pt")["pixel_values"][0]
            size = self.pre.image_size
            img = img.resize((size, size), Image.Resampling.BILINEAR)
            pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
        return (pixels.permute(2, 0, 1).float() / 255.0 - self._mean) / self._std

    def problem(self, record: Record, err: Exception) -> str:
        return f"{self.where(record)}: cannot decode image {record.image}: {str(err)[:200]}"

    def sample_lengths(self) -> list[int]:
        """Every sample's token count, from its record (no image is read): token-budget batches plan with it."""
        return [len(r.prompt_ids) + len(r.target_ids) for r in self.records]

    def sample(self, record: Record) -> dict[str, Any]:
        image = self._image(record)
        ids = [*record.prompt_ids, *record.target_ids]
        labels = [IGNORE_INDEX] * len(record.prompt_ids) + list(record.target_ids)
        return {self.pre.image_key: image, "input_ids": ids, "labels": labels}


class MMCollator:
    """Stacks images and pads token ids (``longest`` in the batch, or ``max_length``)."""

    def __init__(self, pad_token_id: int, image_key: str, padding: str = "longest", max_length: int = 512) -> None:
        self.pad = pad_token_id
        self.image_key = image_key
        self.padding = padding
        self.max_length = max_length

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = self.max_length if self.padding == "max_length" else max(len(s["input_ids"]) for s in samples)
        input_ids = torch.full((len(samples), width), self.pad, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, sample in enumerate(samples):
            n = len(sample["input_ids"])
            input_ids[i, :n] = torch.tensor(sample["input_ids"])
            labels[i, :n] = torch.tensor(sample["labels"])
            mask[i, :n] = 1
        images = torch.stack([s[self.image_key] for s in samples])
        return {self.image_key: images, "input_ids": input_ids, "attention_mask": mask, "labels": labels}
