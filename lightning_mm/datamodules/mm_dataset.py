"""The native multimodal dataset and its collate function (``build_mm_dataset`` / ``build_mm_dataloader``)."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from lightning_mm.datamodules.data_config import PreprocessConfig
from lightning_mm.datamodules.records import Record

__all__ = ["MMDataset", "MMCollator", "load_tokenizer", "load_processor"]

IGNORE_INDEX = -100


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

    return AutoImageProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


class MMDataset(Dataset):
    """Checked records turned into ``{image_key: CxHxW float tensor, input_ids, labels}`` samples."""

    def __init__(self, records: list[Record], preprocess: PreprocessConfig, processor: Any = None) -> None:
        self.records = records
        self.pre = preprocess
        self.processor = processor
        self._mean = torch.tensor(preprocess.image_mean).view(3, 1, 1)
        self._std = torch.tensor(preprocess.image_std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.records)

    def _image(self, record: Record) -> torch.Tensor:
        try:
            with Image.open(record.image) as img:
                img = img.convert("RGB")
                if self.processor is not None:
                    return self.processor(images=img, return_tensors="pt")["pixel_values"][0]
                size = self.pre.image_size
                img = img.resize((size, size), Image.Resampling.BILINEAR)
                pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
        except Exception as err:  # an image that changed since it was checked
            raise RuntimeError(f"{record.file.name}:{record.line}: cannot read image {record.image}: {err}") from err
        return (pixels.permute(2, 0, 1).float() / 255.0 - self._mean) / self._std

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.records[index]
        ids = [*record.prompt_ids, *record.target_ids]
        labels = [IGNORE_INDEX] * len(record.prompt_ids) + list(record.target_ids)
        return {self.pre.image_key: self._image(record), "input_ids": ids, "labels": labels}


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
