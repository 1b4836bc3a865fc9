"""The demo's closing report: a short summary on the terminal and a loss/accuracy plot next to the CSV log.

The plot is an SVG written without plotting libraries (matplotlib is only in the `bench` extra), so the demo
always produces it: ``<log dir>/metrics.svg`` beside ``metrics.csv``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L

CHANCE = 1 / 12  # the demo's captions: 12 equally likely


class CaptioningReport(L.Callback):
    """Records train loss and the validation metrics; prints a summary and writes the plot when fit ends."""

    def __init__(self) -> None:
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, dict[str, float]]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self.train.append((trainer.global_step, float(loss)))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if values:
            self.val.append((trainer.global_step, values))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self.val:
            return
        step, last = self.val[-1]
        best_step, best = max(self.val, key=lambda item: item[1].get("val/caption_acc", 0.0))
        lines = [f"Summary after {trainer.global_step} steps (last validation at step {step}):"]
        if self.train:
            lines.append(
                f"  train/loss       {self.train[0][1]:.3f} at step {self.train[0][0]} -> {self.train[-1][1]:.3f}"
            )
        for key in ("val/loss", "val/token_acc", "val/caption_acc"):
            if key in last:
                lines.append(f"  {key:<16} {last[key]:.3f}")
        if "val/caption_acc" in last:
            lines.append(
                f"  captions right: {last['val/caption_acc']:.0%} (chance {CHANCE:.0%}); best "
                f"{best['val/caption_acc']:.0%} at step {best_step}"
            )
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        if log_dir:
            plot = Path(log_dir) / "metrics.svg"
            plot.parent.mkdir(parents=True, exist_ok=True)
            plot.write_text(svg_plot(self.train, self.val))
            lines.append(f"  logs: {Path(log_dir) / 'metrics.csv'}, plot: {plot}")
        print("\n".join(lines), flush=True)


def _polyline(
    points: list[tuple[float, float]],
    x0: float,
    x1: float,
    y0: float,
    y1: float,
    box: tuple[int, int, int, int],
    colour: str,
) -> str:
    left, top, width, height = box
    if not points or x1 <= x0:
        return ""
    span = (y1 - y0) or 1.0
    coords = " ".join(
        f"{left + (x - x0) / (x1 - x0) * width:.1f},{top + height - (y - y0) / span * height:.1f}" for x, y in points
    )
    return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'


def svg_plot(train: list[tuple[int, float]], val: list[tuple[int, dict[str, float]]]) -> str:
    """Two panels over the training steps: train and val loss; val token and caption accuracy (with chance)."""
    steps = [s for s, _ in train] + [s for s, _ in val]
    x0, x1 = (min(steps), max(steps)) if steps else (0, 1)
    losses = [v for _, v in train] + [m["val/loss"] for _, m in val if "val/loss" in m]
    y_max = max(losses) if losses else 1.0
    width, height, pad = 640, 220, 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{2 * height + pad}" '
        'font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    panels = [
        (
            "loss",
            0.0,
            y_max,
            [
                (train, "train/loss", "#1f77b4"),
                ([(s, m["val/loss"]) for s, m in val if "val/loss" in m], "val/loss", "#d62728"),
            ],
        ),
        (
            "accuracy",
            0.0,
            1.0,
            [
                ([(s, m["val/token_acc"]) for s, m in val if "val/token_acc" in m], "val/token_acc", "#2ca02c"),
                ([(s, m["val/caption_acc"]) for s, m in val if "val/caption_acc" in m], "val/caption_acc", "#9467bd"),
                ([(x0, CHANCE), (x1, CHANCE)], "chance (captions)", "#999999"),
            ],
        ),
    ]
    for i, (title, y0, y1, series) in enumerate(panels):
        box = (pad + 10, i * (height + pad // 2) + 20, width - 2 * pad - 10, height - 40)
        left, top, w, h = box
        parts.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>')
        parts.append(f'<text x="{left}" y="{top - 6}">{title} (steps {x0}-{x1}; y {y0:g}-{y1:.3g})</text>')
        for j, (points, name, colour) in enumerate(series):
            parts.append(_polyline([(float(a), float(b)) for a, b in points], x0, x1, y0, y1, box, colour))
            parts.append(f'<text x="{left + w - 130}" y="{top + 14 + 13 * j}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(p for p in parts if p)
