"""Data: the MindSpeed provider function as a LightningDataModule."""

from lightning_mm.datamodules.datamodule import MMDataModule

__all__ = ["MMDataModule"]
