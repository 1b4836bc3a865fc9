"""Train MindSpeed MM's custom model with MindSpeed MM's fsdp2_config.yaml on 2 CPU processes.

    python examples/custom_model/train.py [--steps 40] [--devices 2]

The model (model.py) is declared ``class TinyVLM(MultiModalModule, FSDP2Mixin, WeightInitMixin)`` exactly as the
migration guide asks; the LightningModule keeps MindSpeed MM's hook names. Data is synthetic: images with captions
made of four token patterns, so the loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model import TinyVLM, TinyVLMConfig  # noqa: E402

from lightning_mm import MMDataModule, MMFSDP2Strategy, MMLightningModule  # noqa: E402


class Captions(torch.utils.data.Dataset):
    """Random images, each with one of four captions (runs of tokens with different strides)."""

    def __init__(self, n: int = 512, seq: int = 16, vocab: int = 256) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        kind = i % 4
        g = torch.Generator().manual_seed(i)
        image = torch.randn(3, 32, 32, generator=g) + kind  # the image tells which caption follows
        ids = (torch.arange(self.seq) * (1 + kind) + 7 * kind) % self.vocab
        return {"images": image, "input_ids": ids, "labels": ids}


def train_valid_test_datasets_provider():
    """MindSpeed MM's provider: (train, valid, test)."""
    return Captions(512), Captions(64), None


class CaptionModule(MMLightningModule):
    def model_provider(self) -> nn.Module:
        return TinyVLM(TinyVLMConfig())

    def get_batch(self, batch):
        return {"images": batch["images"], "input_ids": batch["input_ids"], "labels": batch["labels"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--config", default=str(HERE / "fsdp2_config.yaml"))
    args = parser.parse_args()

    L.seed_everything(0)
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        strategy=MMFSDP2Strategy(fsdp2_config=args.config),
        val_check_interval=20,
        limit_val_batches=4,
        log_every_n_steps=5,
        default_root_dir=str(Path.cwd() / "runs" / "custom_model"),
        enable_checkpointing=False,
    )
    module = CaptionModule(lr=3e-3, warmup_steps=5, lr_decay_style="cosine", min_lr=3e-4)
    data = MMDataModule(train_valid_test_datasets_provider=train_valid_test_datasets_provider, batch_size=8)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"final metrics: {metrics}")


if __name__ == "__main__":
    main()
