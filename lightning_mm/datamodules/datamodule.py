"""MMDataModule: MindSpeed MM's ``train_valid_test_datasets_provider`` (or a data config) as a LightningDataModule."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_mm._compat import attached_trainer, installs_distributed_sampler
from lightning_mm.datamodules.resumable import ResumableDataLoader
from lightning_mm.errors import ConfigError, InputTypeError
from lightning_mm.modules.seed_functions import resolve_callable

__all__ = ["MMDataModule"]

_SPLITS = ("train", "val", "test")


class MMDataModule(L.LightningDataModule):
    """Data from a MindSpeed-style provider, from datasets given directly, or from a data config file.

    * ``train_valid_test_datasets_provider()`` (a callable or an import path) returns ``(train, valid, test)``,
      each a Dataset, a DataLoader or ``None`` (absent split). Datasets are wrapped in DataLoaders with the
      settings below; DataLoaders are used as they are.
    * ``data_config`` (or :meth:`from_config`) names a ``data.json``/YAML file describing sources, preprocessing
      and loading (see :mod:`lightning_mm.data.data_config`), or a MindSpeed MM data config
      (``dataset_param`` + ``dataloader_param``, at the top or under ``data:``; see
      :mod:`lightning_mm.mindspeed.mindspeed_data`); bad records are skipped, counted and reported with file and
      line, or raise in strict mode.

    Lightning replaces the samplers so that every data-parallel rank sees distinct samples (FSDP and HSDP alike).

    Token-budget batches (``max_tokens_per_rank``): the training batches hold at most that many tokens per rank
    instead of ``batch_size`` samples, formed by sorting and first-fit filling within buffers of
    ``packing_buffer_size`` samples (:mod:`lightning_mm.core.token_budget_plan`); deterministic for ``seed``; every
    data-parallel rank runs the same number of steps; resumable mid-epoch (also on another number of ranks).
    ``packing=True`` packs each batch's samples into one row without padding
    (:class:`~lightning_mm.core.packed_rows.PackedCollator`: samples never attend to each other, positions restart
    per sample, no target crosses a boundary); without it batches are padded as usual and the budget counts the
    padding. Validation and test loaders keep ``batch_size``. MindSpeed MM's ``neat_packing`` (with
    ``cutoff_len`` as the budget) maps here.
    """

    def __init__(
        self,
        train_valid_test_datasets_provider: Callable[[], tuple[Any, Any, Any]] | str | None = None,
        train_dataset: Dataset | DataLoader | None = None,
        val_dataset: Dataset | DataLoader | None = None,
        test_dataset: Dataset | DataLoader | None = None,
        data_config: str | os.PathLike | None = None,
        batch_size: int | None = None,
        num_workers: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | None = None,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        seed: int | None = None,
        packing: bool = False,
        max_tokens_per_rank: int | None = None,
        packing_buffer_size: int = 512,
    ) -> None:
        super().__init__()
        sources = sum(x is not None for x in (train_valid_test_datasets_provider, data_config)) + any(
            d is not None for d in (train_dataset, val_dataset, test_dataset)
        )
        if sources != 1:
            raise ConfigError(
                "MMDataModule: give exactly one of train_valid_test_datasets_provider, data_config, or datasets"
            )
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"MMDataModule: batch_size must be positive, got {batch_size}")
        self.provider = resolve_callable(train_valid_test_datasets_provider, "train_valid_test_datasets_provider")
        self.config = None
        # Loading settings: explicit arguments win over the data config's `loader` section, which wins over the
        # defaults (batch size 1, no workers, shuffled training data, seed 0).
        given = {
            "batch_size": batch_size,
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "shuffle": shuffle,
            "drop_last": drop_last,
            "seed": seed,
        }
        settings: dict[str, Any] = {
            "batch_size": 1,
            "num_workers": 0,
            "pin_memory": False,
            "shuffle": True,
            "drop_last": False,
            "seed": 0,
        }
        self.mindspeed_config = None
        if data_config is not None:
            from lightning_mm.data.data_config import DataConfig, DataConfigError
            from lightning_mm.mindspeed.load import data_file_format

            # One entry tells the format: a MindSpeed MM data config (dataset_param/dataloader_param, at the top or
            # under `data:`), else this project's. Either fails now, naming the key, if the file is wrong.
            if data_file_format(data_config, DataConfigError) == "lightning-mm":
                self.config = DataConfig.from_file(data_config)
                settings.update({k: getattr(self.config.loader, k) for k in settings})
            else:
                from lightning_mm.mindspeed.mindspeed_data import read_data_file

                self.mindspeed_config = read_data_file(data_config)
                assert self.mindspeed_config is not None  # the format was told above
                settings.update({k: getattr(self.mindspeed_config, k) for k in ("shuffle", "drop_last", "pin_memory")})
                if self.mindspeed_config.num_workers is not None:
                    settings["num_workers"] = self.mindspeed_config.num_workers
        overridden = {k: v for k, v in given.items() if v is not None}
        if self.config is not None and overridden:
            rank_zero_info(f"MMDataModule: {overridden} override the `loader` section of {self.config.source}")
        if self.mindspeed_config is not None and overridden:
            rank_zero_info(f"MMDataModule: {overridden} override {self.mindspeed_config.loader_section}")
        settings.update(overridden)
        self._splits: dict[str, Any] | None = None
        if self.provider is None and self.config is None and self.mindspeed_config is None:
            self._splits = dict(zip(_SPLITS, (train_dataset, val_dataset, test_dataset)))
        self.batch_size: int = settings["batch_size"]
        self._given_batch_size = batch_size  # checked against DataLoaders given or returned by the provider
        self.num_workers: int = settings["num_workers"]
        self.pin_memory: bool = settings["pin_memory"]
        self.shuffle: bool = settings["shuffle"]
        self.drop_last: bool = settings["drop_last"]
        self.seed: int = settings["seed"]
        self.collate_fn = collate_fn
        self._user_collate = collate_fn is not None
        if self.mindspeed_config is not None and self.mindspeed_config.dataset_type == "huggingface":
            from lightning_mm.mindspeed.hf_data import packing_settings

            ms_packing, max_tokens_per_rank = packing_settings(
                self.mindspeed_config.dataset_param,
                self.mindspeed_config.source,
                self.mindspeed_config.prefix,
                max_tokens_per_rank,
            )
            packing = packing or ms_packing
        self.packing = bool(packing)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.packing_buffer_size = packing_buffer_size
        self._check_token_budget(batch_size)
        self.reports: dict[str, Any] = {}
        self._check_loader_batch_size("given to MMDataModule")

    def _check_token_budget(self, batch_size: int | None) -> None:
        from lightning_mm.core.packed_rows import PackedCollator

        budget = self.max_tokens_per_rank
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"MMDataModule: max_tokens_per_rank must be a positive integer, got {budget!r}")
        size = self.packing_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"MMDataModule: packing_buffer_size must be a positive integer, got {size!r}")
        if self.packing and budget is None:
            raise ConfigError(
                "MMDataModule: packing=True needs max_tokens_per_rank (the tokens of one packed row; "
                "MindSpeed MM: cutoff_len)"
            )
        if budget is not None and batch_size is not None:
            raise ConfigError(
                "MMDataModule: give batch_size or max_tokens_per_rank, not both (token-budget batches "
                "hold as many samples as fit)"
            )
        if self.packing and self._user_collate and not isinstance(self.collate_fn, PackedCollator):
            raise ConfigError(
                "MMDataModule: packing=True packs with lightning_mm.core.packed_rows.PackedCollator; a "
                "collate_fn given with it must be one (e.g. PackedCollator(stack_keys=['images']))"
            )

    @classmethod
    def from_config(cls, path: str | os.PathLike, **overrides: Any) -> MMDataModule:
        """Build the module from a data config file (``data.json`` or YAML)."""
        return cls(data_config=path, **overrides)

    # ----------------------------------------------------------------------------------------- setup
    def setup(self, stage: str | None = None) -> None:
        if self._splits is not None:
            return
        if self.config is not None:
            self._splits = self._from_config()
            return
        if self.mindspeed_config is not None:
            from lightning_mm.mindspeed.mindspeed_data import build_datasets

            self._splits, collate, self.reports = build_datasets(self.mindspeed_config)
            if self.collate_fn is None:
                self.collate_fn = collate
            return
        assert self.provider is not None
        result = self.provider()
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise InputTypeError(
                "train_valid_test_datasets_provider must return (train, valid, test) with None for absent splits, "
                f"got {type(result).__name__}"
            )
        self._splits = dict(zip(_SPLITS, result))
        self._check_loader_batch_size("that train_valid_test_datasets_provider returns")

    def _check_loader_batch_size(self, origin: str) -> None:
        """A DataLoader keeps its own batch size: an explicit ``batch_size`` must agree with it, or the global batch
        (and ``accumulate_grad_batches`` derived from it) would silently differ."""
        if self._given_batch_size is None or self._splits is None:
            return
        for split, loader in self._splits.items():
            if isinstance(loader, DataLoader) and loader.batch_size != self._given_batch_size:
                size = "set by its batch_sampler" if loader.batch_size is None else loader.batch_size
                raise ConfigError(
                    f"MMDataModule: batch_size={self._given_batch_size}, but the {split} DataLoader {origin} has "
                    f"batch size {size}; a DataLoader keeps its own, so make the two agree (or drop batch_size)"
                )

    def _from_config(self) -> dict[str, Any]:
        from lightning_mm.data.mm_dataset import MMCollator, MMDataset, load_processor, load_tokenizer
        from lightning_mm.data.record_files import DataError, read_records

        config = self.config
        assert config is not None
        pre = config.preprocess
        tokenizer = load_tokenizer(pre.tokenizer)
        processor = load_processor(pre.processor) if pre.processor is not None else None
        splits: dict[str, Any] = dict.fromkeys(_SPLITS)
        for split, files in config.splits.items():
            records, report = read_records(
                split,
                files,
                config.data_root,
                tokenizer,
                pre.max_length,
                pre.truncation,
                config.allow_outside_data_root,
            )
            self.reports[split] = report
            if report.problems and config.strict:
                raise DataError(f"bad records in strict mode ({config.source}):\n{report.summary(shown=20)}")
            if report.problems:
                rank_zero_warn(f"data: {report.summary()}")
            else:
                rank_zero_info(f"data: {report.summary()}")
            if not records:
                raise DataError(f"{config.source}: split '{split}' has no usable record:\n{report.summary()}")
            splits[split] = MMDataset(records, pre, processor, strict=config.strict, report=report)
        if self.collate_fn is None:
            self.collate_fn = MMCollator(tokenizer.pad_token_id, pre.image_key, config.loader.padding, pre.max_length)
        return splits

    # ----------------------------------------------------------------------------------------- loaders
    def _loader(self, split: str, shuffle: bool) -> DataLoader | list:
        if self._splits is None:
            self.setup()
        assert self._splits is not None
        data = self._splits[split]
        if data is None:
            return []
        if isinstance(data, DataLoader):
            return data
        iterable = isinstance(data, IterableDataset)
        if split == "train" and self.max_tokens_per_rank is not None:
            return self._token_budget_loader(data, self.max_tokens_per_rank)
        loader_cls = DataLoader if iterable or split != "train" else ResumableDataLoader  # mid-epoch resume
        group_by = getattr(self.mindspeed_config, "group_by", None)
        if split == "train" and group_by is not None and not iterable:
            return loader_cls(
                data,
                batch_size=self.batch_size,
                sampler=self._grouped_sampler(data, group_by),
                num_workers=self.num_workers,
                collate_fn=self.collate_fn,
                pin_memory=self.pin_memory,
            )
        return loader_cls(
            data,
            batch_size=self.batch_size,
            shuffle=shuffle and not iterable,
            sampler=self._unshuffled_distributed_sampler(data) if split == "train" and not shuffle else None,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last and split == "train",
            generator=torch.Generator().manual_seed(self.seed) if shuffle and not iterable else None,
        )

    def _token_budget_loader(self, data: Any, max_tokens: int) -> DataLoader:
        from lightning_mm.core.packed_rows import PackedCollator
        from lightning_mm.datamodules.token_budget_loader import TokenBudgetLoader, sample_lengths, vocab_size_of

        if isinstance(data, IterableDataset) or not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
            raise ConfigError(
                "MMDataModule: max_tokens_per_rank needs a map-style training dataset (with len and "
                f"indexing) to plan the batches from its lengths, got {type(data).__name__}"
            )
        collate = self.collate_fn
        if not self.packing and getattr(collate, "padding", None) == "max_length":
            raise ConfigError(
                "MMDataModule: max_tokens_per_rank counts rows x longest sample, but the data config's "
                "`loader.padding: max_length` pads every row to max_length; use padding: longest, or "
                "packing=True"
            )
        if self.packing and not isinstance(collate, PackedCollator):
            collate = PackedCollator(
                stack_keys=[image_key] if (image_key := getattr(collate, "image_key", None)) else [],
                filler=getattr(collate, "filler", None),
            )
        trainer = attached_trainer(self)
        kwargs = (trainer.distributed_sampler_kwargs or {}) if trainer is not None else {}
        world, rank = int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
        return TokenBudgetLoader(
            data,
            sample_lengths(data),
            max_tokens,
            self.packing_buffer_size,
            self.seed,
            self.shuffle,
            self.packing,
            self.drop_last,
            world,
            rank,
            collate,
            epoch_fn=(lambda: int(trainer.current_epoch)) if trainer is not None else (lambda: 0),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            vocab_size=vocab_size_of(data, trainer.lightning_module if trainer is not None else None),
        )

    def _grouped_sampler(self, data: Any, group_by: str) -> DistributedSampler:
        """MindSpeed MM's ``LengthGroupedSampler`` (``group_data`` / ``group_frame``): batches of one size."""
        from lightning_mm.datamodules.grouped_sampler import GroupedDistributedSampler

        trainer = attached_trainer(self)
        kwargs = (trainer.distributed_sampler_kwargs or {}) if trainer is not None else {}
        return GroupedDistributedSampler(
            data,
            data.group_keys(group_by),
            self.batch_size,
            num_replicas=int(kwargs.get("num_replicas", 1)),
            rank=int(kwargs.get("rank", 0)),
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )

    def _unshuffled_distributed_sampler(self, data: Any) -> DistributedSampler | None:
        """Lightning's training sampler with ``shuffle=False``, or ``None`` when Lightning installs none.

        Lightning always shuffles the ``DistributedSampler`` it puts into a training loader, whatever the loader's
        own sampler; it keeps a loader's ``DistributedSampler``. So ``shuffle: false`` installs the sampler that
        Lightning would (the strategy's ``distributed_sampler_kwargs``), unshuffled.
        """
        trainer = attached_trainer(self)
        if trainer is None or isinstance(data, IterableDataset) or not installs_distributed_sampler(trainer):
            return None
        kwargs = trainer.distributed_sampler_kwargs or {}
        return DistributedSampler(data, shuffle=False, **kwargs)

    def train_dataloader(self) -> DataLoader | list:
        if self._splits is None:
            self.setup()
        if self._splits is not None and self._splits["train"] is None:
            raise ConfigError("MMDataModule: there is no training split (train is None)")
        return self._loader("train", self.shuffle)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader | list:
        return self._loader("test", False)
