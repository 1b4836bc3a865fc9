"""MMLightningModule: the seed's ``pretrain_xxx.py`` hooks as a LightningModule."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch import nn

__all__ = ["MMLightningModule"]


class MMLightningModule(L.LightningModule):
    """A LightningModule whose overridable hooks keep MindSpeed MM's names.

    * ``model_provider()`` builds the model, once, inside ``configure_model`` (under the strategy's meta-device
      context); the result is ``self.model``.
    * ``get_batch(batch)`` turns a DataLoader item into forward inputs.
    * ``forward_step(batch)`` runs the model (``self.model(**batch)`` for a mapping, ``self.model(batch)``
      otherwise). Returning ``(output, loss_fn)`` (the Megatron form) is accepted: the loss is ``loss_fn(output)``.
    * ``loss_func(output, batch)`` returns a loss tensor or a mapping with a ``loss`` key plus values to log.

    Args:
        fsdp2_config: the FSDP2 config the ``mm_fsdp2`` strategy uses when it is given none itself.
        lr, weight_decay, betas: AdamW settings of the default optimiser.
        warmup_steps, lr_decay_style, min_lr: linear warmup, then ``cosine``, ``linear`` or ``constant`` decay to
            ``min_lr`` over the Trainer's estimated total steps.
    """

    def __init__(
        self,
        fsdp2_config: Any = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_decay_style: str = "constant",
        min_lr: float = 0.0,
    ) -> None:
        super().__init__()
        if lr_decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr_decay_style must be 'constant', 'cosine' or 'linear', got {lr_decay_style!r}")
        self.fsdp2_config = fsdp2_config
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.warmup_steps = warmup_steps
        self.lr_decay_style = lr_decay_style
        self.min_lr = min_lr
        self.model: nn.Module | None = None

    # ------------------------------------------------------------------------ the seed's hooks
    def model_provider(self) -> nn.Module:
        """Build and return the model."""
        raise NotImplementedError(f"{type(self).__name__} must implement model_provider()")

    def get_batch(self, batch: Any) -> Any:
        """Turn a DataLoader item into the model's forward inputs (identity by default)."""
        return batch

    def forward_step(self, batch: Any) -> Any:
        """Run the forward pass."""
        assert self.model is not None
        if isinstance(batch, Mapping):
            return self.model(**batch)
        return self.model(batch)

    def loss_func(self, output: Any, batch: Any) -> Any:
        """The loss of ``output``: the output itself if it is a tensor, or its ``loss`` entry / attribute."""
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, Mapping) and "loss" in output:
            return output["loss"]
        if getattr(output, "loss", None) is not None:
            return output.loss
        raise TypeError(
            f"{type(self).__name__}.loss_func cannot find a loss in a {type(output).__name__}; override loss_func"
        )

    # ------------------------------------------------------------------------ Lightning wiring
    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.model_provider()

    def _loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        inputs = self.get_batch(batch)
        output = self.forward_step(inputs)
        if isinstance(output, tuple) and len(output) == 2 and callable(output[1]):
            output, loss_fn = output
            result = loss_fn(output)
        else:
            result = self.loss_func(output, inputs)
        extras: dict[str, Any] = {}
        if isinstance(result, Mapping):
            if "loss" not in result:
                raise KeyError(f"{type(self).__name__}: a loss mapping must have a 'loss' key, got {list(result)}")
            extras = {k: v for k, v in result.items() if k != "loss"}
            result = result["loss"]
        if isinstance(result, tuple):  # (loss, {extras}) as some MindSpeed loss functions return
            result, extras = result[0], dict(result[1]) if len(result) > 1 else {}
        return result, extras

    def _batch_size(self, batch: Any) -> int | None:
        tensor = next(iter(batch.values())) if isinstance(batch, Mapping) and batch else (
            batch[0] if isinstance(batch, (list, tuple)) and batch else batch)
        return tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.ndim > 0 else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, extras = self._loss(batch)
        bs = self._batch_size(batch)
        self.log("train/loss", loss.detach().float(), prog_bar=True, sync_dist=True, batch_size=bs)
        for key, value in extras.items():
            self.log(f"train/{key}", value, sync_dist=True, batch_size=bs)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, extras = self._loss(batch)
        bs = self._batch_size(batch)
        self.log("val/loss", loss.detach().float(), prog_bar=True, sync_dist=True, batch_size=bs)
        for key, value in extras.items():
            self.log(f"val/{key}", value, sync_dist=True, batch_size=bs)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, extras = self._loss(batch)
        bs = self._batch_size(batch)
        self.log("test/loss", loss.detach().float(), sync_dist=True, batch_size=bs)
        for key, value in extras.items():
            self.log(f"test/{key}", value, sync_dist=True, batch_size=bs)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        output = self.forward_step(self.get_batch(batch))
        return output[0] if isinstance(output, tuple) and len(output) == 2 and callable(output[1]) else output

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas)
        if self.warmup_steps == 0 and self.lr_decay_style == "constant":
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_decay_style == "constant":
            return 1.0
        total = max(int(self.trainer.estimated_stepping_batches), self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        floor = self.min_lr / self.lr
        if self.lr_decay_style == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)
