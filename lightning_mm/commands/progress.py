"""The progress bar ``lightning-mm fit`` uses unless the config chooses one.

Lightning's bars show only the metrics logged with ``prog_bar=True`` and, when training is bounded by ``max_steps``
(``max_epochs`` unset), describe the epoch as "Epoch 26/-2". This bar adds every validation metric (``val/...``,
or the names given) and, under ``max_steps``, reads "Epoch 26 · step 3120/4000". Rich is used when it is installed
(as Lightning does), else tqdm.

The bar counts batches of the epoch (``batch_idx + 1``), but Lightning bounds its total under ``max_steps`` by the
optimizer steps left: with ``accumulate_grad_batches=2`` a 4-step run read "8/4", and a run resumed at step 6 of 16
read "16/10". :func:`train_batches_total` gives the total in the bar's own unit.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

__all__ = ["MMProgressBar", "MMTQDMProgressBar", "default_progress_bar", "step_description", "train_batches_total"]


def step_description(trainer: Any) -> str | None:
    """``Epoch E · step S/M`` when training ends at ``max_steps`` rather than at an epoch count; else ``None``."""
    if trainer.max_steps is None or trainer.max_steps < 0 or trainer.max_epochs not in (None, -1):
        return None
    return f"Epoch {trainer.current_epoch} · step {trainer.global_step}/{trainer.max_steps}"


def train_batches_total(trainer: Any) -> int | float:
    """The batch index (1-based, counted from the epoch's start as the bar counts) at which this epoch's training
    ends: the epoch's length, or sooner where ``max_steps`` is reached. The optimizer steps left are turned into
    batches with ``accumulate_grad_batches``, counted from the last step boundary of the batches already processed
    in this epoch (on a resumed run those before the checkpoint too). The value does not change during the epoch."""
    total = trainer.num_training_batches
    max_steps = trainer.max_steps
    if max_steps is None or max_steps < 0:
        return total
    accumulate = max(int(trainer.accumulate_grad_batches), 1)
    processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    boundary = processed // accumulate * accumulate
    remaining = max(max_steps - trainer.global_step, 0)
    return min(total, boundary + remaining * accumulate)


class _ExtraMetrics:
    """Adds logged metrics to the bar: the names given, or every ``val/...`` metric when none are; and counts the
    training total in batches (:func:`train_batches_total`)."""

    extra_metrics: Sequence[str] | None = None
    trainer: Any

    @property
    def total_train_batches(self) -> int | float:
        return train_batches_total(self.trainer)

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        items.pop("v_num", None)
        names = self.extra_metrics
        if names is None:
            names = [k for k in trainer.callback_metrics if k.startswith("val/")]
        for name in names:
            value = trainer.callback_metrics.get(name)
            if value is not None and name not in items:
                items[name] = f"{float(value):.3g}"
        return items


class MMProgressBar(_ExtraMetrics, RichProgressBar):
    """RichProgressBar with the validation metrics and a step count under ``max_steps``."""

    def __init__(self, extra_metrics: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra_metrics = extra_metrics

    def _describe(self, trainer: Any) -> None:
        text = step_description(trainer)
        if text is not None and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=text)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._describe(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        self._describe(trainer)


class MMTQDMProgressBar(_ExtraMetrics, TQDMProgressBar):
    """TQDMProgressBar with the validation metrics and a step count under ``max_steps``."""

    def __init__(self, extra_metrics: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra_metrics = extra_metrics

    _epoch_started = False

    def on_train_start(self, *args: Any) -> None:
        super().on_train_start(*args)
        self._epoch_started = False

    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._epoch_started = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        if not self._epoch_started:
            # Resumed mid-epoch: Lightning calls no on_train_epoch_start, so tqdm had no total ("13/?"); set it up as
            # Lightning's Rich bar does in this case.
            self.on_train_epoch_start(trainer, pl_module)
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        text = step_description(trainer)
        if text is not None and self.train_progress_bar is not None:
            self.train_progress_bar.set_description(text, refresh=False)


def default_progress_bar() -> RichProgressBar | TQDMProgressBar:
    """Rich when it is installed, else tqdm (Lightning's own rule)."""
    return MMProgressBar() if importlib.util.find_spec("rich") is not None else MMTQDMProgressBar()
