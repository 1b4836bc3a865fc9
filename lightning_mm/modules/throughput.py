"""The throughput meter: Lightning's ``ThroughputMonitor`` with token rates, TFLOP/s per device and MFU.

:class:`MMThroughputMonitor` is Lightning's ``ThroughputMonitor`` (same window, same steps, rank 0's timing) whose
per-stage ``Throughput`` meters are :class:`TokenThroughput`: Lightning's metrics plus, over the same window,

* ``tokens_per_sec`` / ``device/tokens_per_sec``: the batches' tokens (non-padding ``input_ids``), and
  ``target_tokens_per_sec`` / ``device/target_tokens_per_sec``: those trained on (``labels != -100``);
* ``tflops_per_device``: model FLOPs (:mod:`lightning_mm.hf.transformers_flops`: forward and backward as trained,
recomputation
  left out) per second per device, in TFLOP/s, and ``hardware_tflops_per_device`` (with recomputation);
* ``mfu`` (model FLOPs) and ``hfu`` (hardware FLOPs) as fractions of the device's dense bf16 peak
  (:data:`lightning_mm.core.flop_formulas.PEAK_TFLOPS`, or the ``peak_tflops`` given); absent when no peak is known
  (a CPU, an unlisted device) and none is given.

The counts are those of rank 0's batches, taken as every rank's (Lightning's convention). Under context
parallelism, a rank's batch is its group's: each of the group's ``C`` ranks is counted ``1/C`` of it.
The module's ``flops_per_batch`` is set to the model FLOPs of each batch, so Lightning's own ``device/flops_per_sec``
and ``device/mfu`` agree with these.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_mm._compat import throughput_meters
from lightning_mm.core.flop_formulas import StepFlops, peak_tflops
from lightning_mm.errors import ConfigError
from lightning_mm.hf.transformers_flops import target_tokens

__all__ = ["MMThroughputMonitor", "TokenThroughput", "device_peak_tflops"]


def device_peak_tflops(device: torch.device) -> float | None:
    """The table's dense bf16 peak of ``device`` (CUDA or Ascend NPU), ``None`` for any other or an unlisted one."""
    if device.type == "cuda":
        return peak_tflops(torch.cuda.get_device_name(device))
    if device.type == "npu":
        npu = getattr(torch, "npu", None)
        name = getattr(npu, "get_device_name", None)
        return peak_tflops(str(name(device))) if callable(name) else None
    return None


class TokenThroughput(Throughput):
    """Lightning's ``Throughput`` plus token rates, TFLOP/s per device and MFU (see the module's docstring).

    Call :meth:`add` with a batch's counts before Lightning's ``update`` for it. ``context_parallel``: the ranks
    that share one batch.
    """

    def __init__(self, *, context_parallel: int = 1, window_size: int = 100, **kwargs: Any) -> None:
        super().__init__(window_size=window_size, **kwargs)
        self.context_parallel = context_parallel
        self._times: deque[float] = deque(maxlen=window_size)
        self._counts: deque[tuple[int | None, ...]] = deque(maxlen=window_size)
        self._pending: tuple[int | None, ...] = (None, None, None, None)  # batches without add(): not counted

    def add(self, tokens: int, targets: int | None, flops: StepFlops | None) -> None:
        """One batch's tokens, target tokens and FLOPs (``None``: unknown)."""
        model = None if flops is None else flops.model
        hardware = None if flops is None else flops.hardware
        self._pending = (tokens, targets, model, hardware)

    @override
    def update(
        self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: int | None = None
    ) -> None:
        super().update(time=time, batches=batches, samples=samples, lengths=lengths, flops=flops)
        self._times.append(time)
        self._counts.append(self._pending)
        self._pending = (None, None, None, None)

    @override
    def compute(self) -> dict[str, int | float]:
        metrics: dict[str, int | float] = dict(super().compute())
        if len(self._times) < 2 or len(self._times) != self._times.maxlen:
            return metrics
        elapsed = self._times[-1] - self._times[0]
        if elapsed <= 0:
            return metrics
        counted = list(self._counts)[1:]  # the batches that ran between the first and the last time
        share = 1.0 / self.context_parallel  # of a batch, per device
        for name, column in (("tokens_per_sec", 0), ("target_tokens_per_sec", 1)):
            values = [c[column] for c in counted]
            if all(v is not None for v in values):
                rate = sum(int(v) for v in values if v is not None) / elapsed
                metrics[f"device{self.separator}{name}"] = rate * share
                metrics[name] = rate * self.world_size
        for name, column, fraction in (("tflops_per_device", 2, "mfu"), ("hardware_tflops_per_device", 3, "hfu")):
            values = [c[column] for c in counted]
            if all(v is not None for v in values):
                per_device = sum(int(v) for v in values if v is not None) / elapsed * share
                metrics[name] = per_device / 1e12
                if self.available_flops:
                    metrics[fraction] = per_device / self.available_flops
        return metrics


class MMThroughputMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` with :class:`TokenThroughput` meters and global rates over data parallelism.

    Lightning multiplies rank 0's rates by the world size; under context parallelism the C ranks of a group share
    their samples, so the global rates count each sample once by multiplying by ``world_size / C`` instead. (A
    ``ThroughputMonitor`` of the user's own, which takes precedence, counts them C times.) The FLOPs of a batch come
    from the LightningModule's ``step_flops(batch)`` when it has one (``None``: not counted); the peak from
    ``peak_tflops`` (TFLOP/s per device; ``None``: the table's entry for the device, none on CPU).
    """

    def __init__(self, *args: Any, peak_tflops: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if peak_tflops is not None and not peak_tflops > 0:
            raise ConfigError(f"peak_tflops must be a positive number of TFLOP/s per device, got {peak_tflops!r}")
        self.peak_tflops = peak_tflops

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        peak = self.peak_tflops if self.peak_tflops is not None else device_peak_tflops(trainer.strategy.root_device)
        self.available_flops = None if peak is None else int(peak * 1e12)
        cp = max(1, int(getattr(trainer.strategy, "context_parallel_size", 1)))
        meters = throughput_meters(self)
        for key in list(meters):
            meters[key] = TokenThroughput(
                available_flops=self.available_flops,
                world_size=max(1, trainer.world_size // cp),
                context_parallel=cp,
                **self.kwargs,
            )

    @override
    @rank_zero_only
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        meter = throughput_meters(self).get(RunningStage.TRAINING)
        if isinstance(meter, TokenThroughput):
            count = getattr(pl_module, "step_flops", None)
            flops = count(batch) if callable(count) else None
            tokens = self.length_fn(batch) if self.length_fn is not None else self.batch_size_fn(batch)
            meter.add(tokens, target_tokens(batch), flops)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
