"""Train Transformers' InternVL the MindSpeed MM way, on 2 CPU processes (MindSpeed MM's InternVL 3.5 workflow).

    python examples/internvl/train.py [--steps 30] [--devices 2] [--hf-path DIR]

1. model.py: the adapter ``InternVLChatModelGeneration(InternVLForConditionalGeneration, FSDP2Mixin,
   WeightInitMixin)``, registered in ``ModelHub.MODEL_MAPPINGS['internvl']``.
2. ``model_provider`` returns ``TransformersModel(deepcopy(args.mm.model))``; ``args.mm.model`` names the ModelHub
   key, the Hugging Face directory to start from and the modules to freeze.
3. ``MMFSDP2Strategy`` shards it with MindSpeed MM-style ``fsdp2_config.yaml`` beside this file; each rank reads only
   its own shards of the checkpoint's weights.

No hub download: a small InternVL configuration is built here and saved with ``save_pretrained`` (standing in for
a downloaded InternVL 3.5 checkpoint) the first time. Data are synthetic: an image of one of four kinds, then a
caption that depends on the kind, so the loss falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import os
import sys
from copy import deepcopy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import model as _adapter  # noqa: E402,F401  (steps 1 and 2: the adapter, registered in ModelHub)

from lightning_mm import MMDataModule, MMFSDP2Strategy, MMLightningModule  # noqa: E402
from lightning_mm.modules import TransformersModel  # noqa: E402

VOCAB, SEQ, IMAGE_TOKEN = 256, 16, 3


def build_tiny_internvl(path: Path) -> None:
    """A small InternVL (InternViT-style vision tower + Qwen2 decoder), randomly initialised, saved to ``path``."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    torch.manual_seed(0)
    config = InternVLConfig(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=[28, 28],
            patch_size=[14, 14],
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        image_token_id=IMAGE_TOKEN,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    config.architectures = ["InternVLForConditionalGeneration"]
    InternVLForConditionalGeneration(config).save_pretrained(path)


class Captions(torch.utils.data.Dataset):
    """A 28x28 image of one of four kinds (one image token after pixel shuffle), then its caption."""

    def __init__(self, n: int = 512) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        kind = i % 4
        g = torch.Generator().manual_seed(i)
        image = torch.randn(3, 28, 28, generator=g) * 0.5 + (kind - 1.5)
        caption = (torch.arange(SEQ - 2) * (1 + kind) + 10 + 7 * kind) % (VOCAB - 10) + 10
        ids = torch.cat([torch.tensor([1, IMAGE_TOKEN]), caption])
        labels = ids.clone()
        labels[:2] = -100
        return {"pixel_values": image, "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def train_valid_test_datasets_provider():
    """MindSpeed MM's provider: (train, valid, test)."""
    return Captions(512), Captions(64), None


class InternVLModule(MMLightningModule):
    """MindSpeed MM's ``pretrain_internvl.py`` hooks."""

    def __init__(self, args: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.args = args

    def model_provider(self) -> nn.Module:
        return TransformersModel(deepcopy(self.args.mm.model))

    def get_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in ("pixel_values", "input_ids", "attention_mask", "labels")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--config", default=str(HERE / "fsdp2_config.yaml"))
    parser.add_argument("--hf-path", default=str(Path.cwd() / "runs" / "internvl" / "tiny-internvl"))
    cli = parser.parse_args()

    hf_path = Path(cli.hf_path)
    if not (hf_path / "config.json").is_file():
        if os.environ.get("LOCAL_RANK", "0") != "0":
            raise FileNotFoundError(f"{hf_path}: the launching process should have built the tiny InternVL")
        build_tiny_internvl(hf_path)

    # MindSpeed MM's `args.mm.model`: the model section of its config.
    args = SimpleNamespace(
        mm=SimpleNamespace(
            model=SimpleNamespace(
                model_id="internvl",
                init_from_hf_path=str(hf_path),
                freeze=["model.vision_tower"],
            )
        )
    )

    L.seed_everything(0)
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cli.devices,
        max_steps=cli.steps,
        strategy=MMFSDP2Strategy(fsdp2_config=cli.config),
        val_check_interval=min(20, cli.steps),
        limit_val_batches=2,
        log_every_n_steps=5,
        default_root_dir=str(Path.cwd() / "runs" / "internvl"),
        enable_checkpointing=False,
    )
    module = InternVLModule(args, lr=3e-3, warmup_steps=3, lr_decay_style="cosine", min_lr=3e-4)
    data = MMDataModule(train_valid_test_datasets_provider=train_valid_test_datasets_provider, batch_size=8)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"model: {type(module.model).__name__}; final metrics: {metrics}")


if __name__ == "__main__":
    main()
