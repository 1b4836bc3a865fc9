"""A MindSpeed MM-style entry script: the five functions of the migration guide, unchanged in shape.

In MindSpeed MM these are called by Megatron's training loop (``pretrain(...)``). With lightning-mm they are
reused as they are: ``examples/migration/config.yaml`` names them by import path, and
``examples/migration/train_lightning.py`` passes them to MMLightningModule / MMDataModule in Python.
The only edit a real script needs is dropping Megatron globals (``get_args()``): Lightning moves the batch to
the device, and the dtype comes from the FSDP2 YAML.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mm.modules import FSDP2Mixin, MultiModalModule, WeightInitMixin


class ResidualMLP(nn.Module):
    """One layer: ``x + mlp(norm(x))``.

    The residual add is inside the layer, so what an FSDP unit returns is a fresh tensor. (A bare ``nn.Sequential``
    ending in ``nn.Linear`` returns a view of a 3-D input, and FSDP2 warns that an in-place op on such a view would
    skip its backward hook; ``x = x + layer(x)`` was out of place and safe, but the warning was noise.)
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class CustomModel(MultiModalModule, FSDP2Mixin, WeightInitMixin):
    """The user's own model: only the base classes changed."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        hidden = config["hidden_size"]
        self.embedding = nn.Embedding(config["vocab_size"], hidden)
        self.layers = nn.ModuleList(ResidualMLP(hidden) for _ in range(config["num_layers"]))
        self.output_layer = nn.Linear(hidden, config["vocab_size"], bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.output_layer(x)
        return {"logits": logits, "labels": labels}


class CustomDataset(Dataset):
    """Sequences that count up modulo the vocabulary: the next token is predictable."""

    def __init__(self, size: int, seq_len: int = 16, vocab: int = 64) -> None:
        self.size, self.seq_len, self.vocab = size, seq_len, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.seq_len + 1) + i) % self.vocab
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def build_dataloader(dataset: Dataset, shuffle: bool = True) -> DataLoader:
    return DataLoader(dataset, batch_size=4, shuffle=shuffle)  # the launch's --micro-batch-size


# ----------------------------------------------------------------------------- the five seed functions
def model_provider(*args, **kwargs) -> nn.Module:
    """Builds the model."""
    config = {"vocab_size": 64, "hidden_size": 64, "num_layers": 4}
    return CustomModel(config)


def get_batch(data_iterator):
    """Generate a batch."""
    if data_iterator is not None:
        batch = next(data_iterator)
    else:
        raise ValueError("Data iterator is None. Unable to retrieve batch.")
    return batch


def loss_func(output_tensor):
    """Loss from the model output; returns (loss, values to log) as Megatron loss functions do."""
    logits, labels = output_tensor["logits"], output_tensor["labels"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """Forward step."""
    batch_data = get_batch(data_iterator)
    output_tensor = model(**batch_data)
    return output_tensor, loss_func


def train_valid_test_datasets_provider():
    """Build train, valid, and test datasets."""
    train_dataloader = build_dataloader(CustomDataset(512))
    valid_dataloader = build_dataloader(CustomDataset(64), shuffle=False)
    test_dataloader = None
    return train_dataloader, valid_dataloader, test_dataloader
