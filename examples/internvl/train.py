"""Train Transformers' InternVL the MindSpeed MM way, on 2 CPU processes (MindSpeed MM's InternVL 3.5 workflow).

    python examples/internvl/train.py [--steps 30] [--devices 2] [--hf-path DIR]

1. model.py: the adapter ``InternVLChatModelGeneration(InternVLForConditionalGeneration, FSDP2Mixin,
   WeightInitMixin)``, registered in ``ModelHub.MODEL_MAPPINGS['internvl']``.
2. ``model_provider`` returns ``TransformersModel(deepcopy(args.mm.model))``; ``args.mm.model`` names the ModelHub
   key, the Hugging Face directory to start from and the modules to freeze.
3. ``MMFSDP2Strategy`` shards it with MindSpeed MM-style ``fsdp2_config.yaml`` beside this file; each rank reads only
   its own shards of the checkpoint's weights.

No hub download: a small InternVL (``lightning_mm.testing.tiny_internvl``, the tests' own) is built and saved with
``save_pretrained`` (standing in for a downloaded InternVL 3.5 checkpoint) the first time. Data are synthetic: an
image of one of four kinds, then a caption that depends on the kind, so the loss falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
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
from lightning_mm.testing.tiny_internvl import TILE, TOKENS_PER_TILE, build_tiny_internvl  # noqa: E402

SEQ = 16  # caption tokens after the image's


class Captions(torch.utils.data.Dataset):
    """A one-tile image of one of four kinds (its image tokens after pixel shuffle), then its caption."""

    def __init__(self, n: int, vocab_size: int, image_token_id: int) -> None:
        self.n, self.vocab, self.image_token = n, vocab_size, image_token_id

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        kind = i % 4
        g = torch.Generator().manual_seed(i)
        image = torch.randn(3, TILE, TILE, generator=g) * 0.5 + (kind - 1.5)
        caption = (torch.arange(SEQ) * (1 + kind) + 10 + 7 * kind) % (self.vocab - 10) + 10
        caption[caption == self.image_token] += 1
        ids = torch.cat([torch.full((TOKENS_PER_TILE,), self.image_token), caption])
        labels = ids.clone()
        labels[:TOKENS_PER_TILE] = -100
        return {"pixel_values": image, "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def datasets_provider(hf_path: Path) -> Callable[[], tuple[Captions, Captions, None]]:
    """MindSpeed MM's provider, ``() -> (train, valid, test)``, for the model directory's vocabulary and image token."""
    config = json.loads((hf_path / "config.json").read_text())
    vocab, image_token = config["text_config"]["vocab_size"], config["image_token_id"]

    def train_valid_test_datasets_provider() -> tuple[Captions, Captions, None]:
        return Captions(512, vocab, image_token), Captions(64, vocab, image_token), None

    return train_valid_test_datasets_provider


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
    data = MMDataModule(train_valid_test_datasets_provider=datasets_provider(hf_path), batch_size=8)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"model: {type(module.model).__name__}; final metrics: {metrics}")


if __name__ == "__main__":
    main()
