"""The native multimodal dataset and its collate function (``build_mm_dataset`` / ``build_mm_dataloader``)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from lightning_mm.datamodules.data_config import DataConfigError, PreprocessConfig
from lightning_mm.datamodules.records import DataError, DataReport, Record

__all__ = ["MMDataset", "MMCollator", "load_tokenizer", "load_processor"]

IGNORE_INDEX = -100
MAX_FAILURES_IN_A_ROW = 32
"""Decode failures one sample may run into before the dataset gives up instead of trying every record."""


def load_tokenizer(path: Any) -> Any:
    """A Hugging Face tokenizer from a local directory (never the hub, never remote code)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        raise ValueError(f"the tokenizer in {path} has no pad token; set `pad_token` in its tokenizer config")
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
            raise DataConfigError(f"{path}: image processor `{key}` is {values}: every image would be NaN or "
                                  "infinite after normalisation (a std must be finite and non-zero)")


class MMDataset(Dataset):
    """Checked records turned into ``{image_key: CxHxW float tensor, input_ids, labels}`` samples.

    An image that passed the up-front check (``PIL.Image.verify``, headers and checksums) can still fail to
    decode (a corrupt pixel stream). Then, in the default mode, the sample at that index is the next record (in
    file order, wrapping around) whose image decodes: the dataset keeps its length, so every data-parallel rank
    still yields the same number of batches and no collective waits on a missing one. The failed record is
    counted once in ``report`` (the same :class:`DataReport` as the up-front problems, with file:line), warned
    about, and never decoded again in this process; :data:`MAX_FAILURES_IN_A_ROW` failures for one sample are an
    error (something systematic, not one bad file). With ``num_workers > 0`` that happens in the worker processes:
    each warns, but the main process's report does not see their counts. In strict mode the failure is a
    :class:`DataError` naming the record.
    """

    def __init__(
        self,
        records: list[Record],
        preprocess: PreprocessConfig,
        processor: Any = None,
        strict: bool = False,
        report: DataReport | None = None,
    ) -> None:
        self.records = records
        self.pre = preprocess
        self.processor = processor
        self.strict = strict
        self.report = report if report is not None else DataReport("data")
        self.bad: set[int] = set()  # indices whose image failed to decode here
        self._mean = torch.tensor(preprocess.image_mean).view(3, 1, 1)
        self._std = torch.tensor(preprocess.image_std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.records)

    def _image(self, record: Record) -> torch.Tensor:
        with Image.open(record.image) as img:
            img = img.convert("RGB")
            if self.processor is not None:
                return self.processor(images=img, return_tensors="pt")["pixel_values"][0]
            size = self.pre.image_size
            img = img.resize((size, size), Image.Resampling.BILINEAR)
            pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
        return (pixels.permute(2, 0, 1).float() / 255.0 - self._mean) / self._std

    def _skip(self, index: int, err: Exception) -> None:
        record = self.records[index]
        problem = f"{record.file.name}:{record.line}: cannot decode image {record.image}: {str(err)[:200]}"
        if self.strict:
            raise DataError(f"bad record in strict mode: {problem}") from err
        self.bad.add(index)
        self.report.problems.append(f"{problem} (at load time; the next good record is used in its place)")
        warnings.warn(f"data: skipped {problem}; the next good record is used in its place", stacklevel=3)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.records)
        failures = 0
        for step in range(n):
            current = (index + step) % n
            if current in self.bad:
                continue
            record = self.records[current]
            try:
                image = self._image(record)
            except Exception as err:  # PIL raises many types for a corrupt stream
                self._skip(current, err)
                failures += 1
                if failures >= MAX_FAILURES_IN_A_ROW:
                    raise DataError(
                        f"{self.report.split}: {failures} images in a row failed to decode (the last at "
                        f"{record.file.name}:{record.line}); the data or the image processor is broken"
                    ) from err
                continue
            ids = [*record.prompt_ids, *record.target_ids]
            labels = [IGNORE_INDEX] * len(record.prompt_ids) + list(record.target_ids)
            return {self.pre.image_key: image, "input_ids": ids, "labels": labels}
        raise DataError(f"{self.report.split}: no record has an image that decodes ({len(self.bad)} failed)")


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
