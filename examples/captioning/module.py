"""The captioning demo: TinyVLM (a vision encoder + text decoder) trained on generated pictures and captions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from examples.captioning.assets import ensure_assets
from examples.custom_model.model import TinyVLM, TinyVLMConfig
from lightning_mm import MMDataModule, MMLightningModule

HERE = Path(__file__).resolve().parent


class CaptioningModule(MMLightningModule):
    """Next-token loss on the caption; logs token accuracy and exact-caption accuracy (chance: 1 in 12)."""

    def __init__(self, vocab_size: int = 12, hidden_size: int = 64, num_layers: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_config = TinyVLMConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers)

    def model_provider(self) -> nn.Module:
        return TinyVLM(self.model_config)

    def get_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"images": batch["images"], "input_ids": batch["input_ids"], "labels": batch["labels"]}

    def loss_func(self, output: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        predicted = output["logits"][:, :-1].argmax(-1)
        target = batch["labels"][:, 1:]
        scored = target != -100
        correct = (predicted == target) & scored
        token_acc = correct.sum() / scored.sum().clamp(min=1)
        caption_acc = (correct | ~scored).all(dim=1).float().mean()
        return {"loss": output["loss"], "token_acc": token_acc, "caption_acc": caption_acc}


class CaptioningData(MMDataModule):
    """MMDataModule over ``data.yaml``; the pictures, captions and tokenizer are generated on first use."""

    def __init__(self, data_config: str = str(HERE / "data.yaml"), **kwargs: Any) -> None:
        ensure_assets(HERE / "assets")
        super().__init__(data_config=data_config, **kwargs)
