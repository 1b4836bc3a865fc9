"""MMDataModule: the seed's ``train_valid_test_datasets_provider`` as a LightningDataModule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["MMDataModule"]

_SPLITS = ("train", "val", "test")


class MMDataModule(L.LightningDataModule):
    """Data from a MindSpeed-style provider, or from datasets given directly.

    ``train_valid_test_datasets_provider()`` returns ``(train, valid, test)``, each a Dataset, a DataLoader or
    ``None`` (absent split). Datasets are wrapped in DataLoaders with the settings below; DataLoaders are used
    as they are. Lightning replaces the sampler so that every data-parallel rank sees distinct samples.
    """

    def __init__(
        self,
        train_valid_test_datasets_provider: Callable[[], tuple[Any, Any, Any]] | None = None,
        train_dataset: Dataset | DataLoader | None = None,
        val_dataset: Dataset | DataLoader | None = None,
        test_dataset: Dataset | DataLoader | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        given = any(d is not None for d in (train_dataset, val_dataset, test_dataset))
        if train_valid_test_datasets_provider is not None and given:
            raise ValueError("MMDataModule: pass either train_valid_test_datasets_provider or datasets, not both")
        if batch_size < 1:
            raise ValueError(f"MMDataModule: batch_size must be positive, got {batch_size}")
        self.provider = train_valid_test_datasets_provider
        self._splits: dict[str, Any] | None = (
            None if self.provider is not None else dict(zip(_SPLITS, (train_dataset, val_dataset, test_dataset)))
        )
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.shuffle = shuffle
        self.drop_last = drop_last

    def setup(self, stage: str | None = None) -> None:
        if self._splits is not None:
            return
        assert self.provider is not None
        result = self.provider()
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise TypeError(
                "train_valid_test_datasets_provider must return (train, valid, test) with None for absent splits, "
                f"got {type(result).__name__}"
            )
        self._splits = dict(zip(_SPLITS, result))

    def _loader(self, split: str, shuffle: bool) -> DataLoader | list:
        if self._splits is None:
            self.setup()
        assert self._splits is not None
        data = self._splits[split]
        if data is None:
            return []
        if isinstance(data, DataLoader):
            return data
        return DataLoader(
            data,
            batch_size=self.batch_size,
            shuffle=shuffle and not isinstance(data, IterableDataset),
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last and split == "train",
        )

    def train_dataloader(self) -> DataLoader | list:
        if self._splits is None:
            self.setup()
        if self._splits and self._splits["train"] is None:
            raise ValueError("MMDataModule: the provider returned no training split (train is None)")
        return self._loader("train", self.shuffle)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader | list:
        return self._loader("test", False)
