"""The captioning demo: TinyVLM (a vision encoder + text decoder) trained on generated pictures and captions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassExactMatch

from examples.captioning.assets import ensure_assets
from examples.custom_model.model import TinyVLM, TinyVLMConfig
from lightning_mm import MMDataModule, MMLightningModule

HERE = Path(__file__).resolve().parent
IGNORE = -100  # the label of positions that are not scored (the prompt, padding)


class CaptioningModule(MMLightningModule):
    """Next-token loss on the caption; logs token accuracy and exact-caption accuracy (chance: 1 in 12).

    Both are torchmetrics metrics, one pair per stage: over an epoch they count every scored token (and caption) of
    every rank, and the training values of a step count both ranks' batches.
    """

    def __init__(self, vocab_size: int = 12, hidden_size: int = 64, num_layers: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_config = TinyVLMConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers)
        self.accuracy = nn.ModuleDict(
            {
                stage: MetricCollection(
                    {
                        "token_acc": MulticlassAccuracy(vocab_size, average="micro", ignore_index=IGNORE),
                        "caption_acc": MulticlassExactMatch(vocab_size, ignore_index=IGNORE),
                    },
                    compute_groups=False,
                )
                for stage in ("train_acc", "val_acc", "test_acc")  # ("train" would shadow nn.Module.train)
            }
        )
        for metric in self.accuracy["train_acc"].values():
            metric.dist_sync_on_step = True  # the step value of a logged training step covers every rank

    def model_provider(self) -> nn.Module:
        return TinyVLM(self.model_config)

    def get_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"images": batch["images"], "input_ids": batch["input_ids"], "labels": batch["labels"]}

    def loss_func(self, output: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        predicted = output["logits"][:, :-1].argmax(-1)
        target = batch["labels"][:, 1:]
        stage = "train" if self.training else "test" if self.trainer.testing else "val"
        metrics = self.accuracy[f"{stage}_acc"]
        if predicted.is_meta:  # `lightning-mm plan --trace-order` runs a step on the meta device: nothing to count
            return output["loss"]
        for metric in metrics.values():
            if stage == "train":
                metric(predicted, target)  # updates the state and keeps this step's value for the step log
            else:
                metric.update(predicted, target)  # logged per epoch
        return {"loss": output["loss"], **metrics}


class CaptioningData(MMDataModule):
    """MMDataModule over ``data.yaml``; the pictures, captions and tokenizer are generated on first use."""

    def __init__(self, data_config: str = str(HERE / "data.yaml"), **kwargs: Any) -> None:
        ensure_assets(HERE / "assets")
        super().__init__(data_config=data_config, **kwargs)
