"""A MindSpeed MM-style entry script for a causal LM (``tests/test_migrated_training.py``): its launch script starts
``torchrun tests/helpers/migrated_llm_entry.py --mm-model model.json ...``, and the one seed function it defines,
``train_valid_test_datasets_provider``, gives the token data (the model comes from the model.json, as MindSpeed MM's
``pretrain_transformers.py`` builds it). ``lightning-mm migrate`` names the function by its import path."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

VOCAB = 300  # below the tiny Qwen3's vocabulary (the tiny Qwen3-VL tokenizer's ~400 tokens)
SEQ_LEN = 12


class TokenDataset(Dataset):
    """Fixed random token rows; the labels are the tokens (the model shifts them), the first three ignored."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (size, SEQ_LEN), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.rows[i].clone()
        labels[:3] = -100
        return {"input_ids": self.rows[i], "labels": labels}


def train_valid_test_datasets_provider() -> tuple[Dataset, None, None]:
    """Build train, valid, and test datasets."""
    return TokenDataset(16, seed=11), None, None
