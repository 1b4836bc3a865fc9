"""MMLightningModule: MindSpeed MM's ``pretrain_xxx.py`` hooks as a LightningModule."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_mm._compat import attached_trainer, should_update_logs
from lightning_mm.core.flop_formulas import StepFlops
from lightning_mm.core.grad_clip import total_grad_norm
from lightning_mm.core.optimizer import group_by_sharding
from lightning_mm.core.recompute import is_recomputed
from lightning_mm.errors import ConfigError, InputKeyError, InputTypeError, StateError
from lightning_mm.hf.batch_check import BatchCheck, has_batch_check
from lightning_mm.hf.transformers_flops import FlopCounter, UnsupportedFlopsModel
from lightning_mm.modules.seed_functions import SeedFunctions, resolve_callable
from lightning_mm.modules.throughput import MMThroughputMonitor
from lightning_mm.strategies.precision import MMFSDP2Precision

__all__ = ["MMLightningModule"]

_DECAY_STYLES = ("constant", "cosine", "linear")


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay_style: str, min_lr_ratio: float) -> float:
    """Megatron-style schedule as a multiple of the peak lr: linear warmup, then decay to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_style == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if decay_style == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)


class MMLightningModule(L.LightningModule):
    """A LightningModule whose hooks keep MindSpeed MM's names.

    Override the hooks, or pass MindSpeed MM's functions (callables or import paths such as
    ``"pretrain_custom.forward_step"``) to the constructor; those are called with MindSpeed MM's own signatures:
    ``model_provider()``, ``get_batch(data_iterator)``, ``forward_step(data_iterator, model)`` and
    ``loss_func(output)``.

    * ``model_provider()`` builds the model, once, inside ``configure_model`` (under the strategy's meta-device
      context); the result is ``self.model``.
    * ``get_batch(batch)`` turns a DataLoader item into forward inputs.
    * ``forward_step(batch)`` runs the model (``self.model(**batch)`` for a mapping, ``self.model(batch)``
      otherwise). Returning ``(output, loss_fn)`` (the Megatron form) is accepted: the loss is ``loss_fn(output)``.
      A model built by ``TransformersModel`` checks each call itself, whoever makes it (a forward pre-hook:
      :mod:`lightning_mm.hf.batch_check`), so MindSpeed MM's ``forward_step`` and overrides are checked too. For any
      other Transformers model the default ``forward_step`` runs the same check before it calls the model (every
      key, and as many image placeholder tokens as the images make), in full on the first batch of each stage and
      key set.
    * ``loss_func(output, batch)`` returns a loss tensor, a mapping with a ``loss`` key plus values to log, or
      ``(loss, {name: value})``.

    Args:
        model_provider, get_batch, forward_step, loss_func: MindSpeed MM's functions, instead of overriding.
        fsdp2_config: the FSDP2 config the ``mm_fsdp2`` strategy uses when it is given none itself.
        lr, weight_decay, betas, eps: AdamW settings of the default optimiser (``eps``: its denominator term).
        warmup_steps: linear warmup length in optimizer steps.
        lr_decay_style: ``constant``, ``cosine`` or ``linear`` decay to ``min_lr`` over the Trainer's total steps.
        min_lr: the floor of the decay.
        log_grad_norm: log the global gradient norm (one reduction on each step whose logs are written, shared with
            norm clipping under ``MMFSDP2Strategy``).
        log_throughput: add Lightning's ``ThroughputMonitor`` (unless the Trainer has one already).
        peak_tflops: the device's peak in TFLOP/s for ``train/mfu`` (``None``: the dense bf16 peak of the table in
            :mod:`lightning_mm.core.flop_formulas` for an H100, H200, B200, A100 or Ascend 910B/910C; no MFU on CPU).
        enable_chunk_loss: compute the default loss (the Transformers model's own, from ``labels``) in chunks of
            ``chunk_loss_size`` tokens from the final hidden states and the output layer's weight, without the
            ``[tokens, vocab]`` logits; loss and gradients equal the unchunked loss
            (:mod:`lightning_mm.hf.chunk_loss`). The model (or the outermost Transformers model in it) must
            have an ``nn.Linear`` output layer (LoRA on it allowed).
        chunk_loss_size: tokens per chunk of ``enable_chunk_loss``.

    Logged: ``train/loss`` (synchronised across ranks) and ``train/lr`` every step; ``train/grad_norm`` (over all
    ranks and shards) on the steps whose logs Lightning writes (``Trainer(log_every_n_steps)``); validation and
    test losses per epoch, and any extra values the loss function returns. Throughput comes from Lightning's
    ``ThroughputMonitor``, to the loggers on the same steps, as a rolling average over the last
    ``log_every_n_steps`` steps measured on rank 0: ``train/device/samples_per_sec``, ``train/device/items_per_sec``
    (tokens: the non-padding ``input_ids`` when the batch has them, else one per sample) and, with more than one
    rank, the global ``train/samples_per_sec`` and ``train/items_per_sec`` (the device rates times the world size).
    For a Transformers model the monitor also logs ``train/tokens_per_sec`` and ``train/target_tokens_per_sec``
    (and per device), ``train/tflops_per_device``, ``train/hardware_tflops_per_device`` and, where a peak is known,
    ``train/mfu`` and ``train/hfu``, from the FLOPs :class:`~lightning_mm.hf.transformers_flops.FlopCounter` counts
    for each batch
    (:mod:`lightning_mm.modules.throughput`; docs/hf-models.md). Set ``flops_per_batch`` yourself (e.g. with
    ``lightning.fabric.utilities.throughput.measure_flops``) for another model; it then wins.
    """

    flops_per_batch: int | None = None  # read by ThroughputMonitor on every step; None: no FLOPs or MFU

    def __init__(
        self,
        model_provider: Callable[..., nn.Module] | str | None = None,
        get_batch: Callable[..., Any] | str | None = None,
        forward_step: Callable[..., Any] | str | None = None,
        loss_func: Callable[..., Any] | str | None = None,
        fsdp2_config: Any = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        lr_decay_style: str = "constant",
        min_lr: float = 0.0,
        log_grad_norm: bool = True,
        log_throughput: bool = True,
        peak_tflops: float | None = None,
        enable_chunk_loss: bool = False,
        chunk_loss_size: int = 1024,
    ) -> None:
        super().__init__()
        if lr_decay_style not in _DECAY_STYLES:
            raise ConfigError(f"lr_decay_style must be one of {_DECAY_STYLES}, got {lr_decay_style!r}")
        if lr <= 0 or min_lr < 0 or min_lr > lr:
            raise ConfigError(f"need 0 <= min_lr <= lr and lr > 0, got lr={lr}, min_lr={min_lr}")
        if warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ConfigError(f"eps must be a positive number (AdamW's denominator term), got {eps!r}")
        if not isinstance(enable_chunk_loss, bool):
            raise ConfigError(f"enable_chunk_loss must be true or false, got {enable_chunk_loss!r}")
        if isinstance(chunk_loss_size, bool) or not isinstance(chunk_loss_size, int) or chunk_loss_size <= 0:
            raise ConfigError(f"chunk_loss_size must be a positive number of tokens, got {chunk_loss_size!r}")
        self._seed = SeedFunctions(
            model_provider=resolve_callable(model_provider, "model_provider"),
            get_batch=resolve_callable(get_batch, "get_batch"),
            forward_step=resolve_callable(forward_step, "forward_step"),
            loss_func=resolve_callable(loss_func, "loss_func"),
        )
        self.fsdp2_config = fsdp2_config
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = cast("tuple[float, float]", tuple(betas))  # the annotation's pair; a config's list as a tuple
        self.eps = float(eps)
        self.warmup_steps = warmup_steps
        self.lr_decay_style = lr_decay_style
        self.min_lr = min_lr
        self.log_grad_norm = log_grad_norm
        self.log_throughput = log_throughput
        if peak_tflops is not None and (isinstance(peak_tflops, bool) or not float(peak_tflops) > 0):
            raise ConfigError(f"peak_tflops must be a positive number of TFLOP/s per device, got {peak_tflops!r}")
        self.peak_tflops = None if peak_tflops is None else float(peak_tflops)
        self._flop_counter: FlopCounter | bool | None = None  # None: not looked for yet; False: none
        self.enable_chunk_loss = enable_chunk_loss
        self.chunk_loss_size = chunk_loss_size
        self.model: nn.Module | None = None
        self._batch_check = BatchCheck()

    # ------------------------------------------------------------------------ MindSpeed MM's hooks
    def model_provider(self) -> nn.Module:
        """Build and return the model."""
        if self._seed.model_provider is not None:
            return self._seed.model_provider()
        raise NotImplementedError(
            f"{type(self).__name__}: override model_provider() or pass model_provider= to the constructor"
        )

    def get_batch(self, batch: Any) -> Any:
        """Turn a DataLoader item into the model's forward inputs (identity by default)."""
        if self._seed.get_batch is not None:
            return self._seed.get_batch(iter([batch]))
        return batch

    def forward_step(self, batch: Any) -> Any:
        """Run the forward pass; may return ``(output, loss_fn)``."""
        if self._seed.forward_step is not None:
            return self._seed.forward_step(iter([batch]), self.model)
        if self.model is None:
            raise StateError(f"{type(self).__name__}.model is not built (configure_model has not run)")
        if isinstance(batch, Mapping):
            if not has_batch_check(self.model):  # a TransformersModel checks its own calls
                self._batch_check(self.model, batch, self._batch_check_context())
            return self.model(**batch)
        return self.model(batch)

    def _batch_check_context(self) -> tuple[Any, ...]:
        """What makes a batch "first" for the batch check: the trainer, its entry point and its stage."""
        trainer = attached_trainer(self)
        if trainer is None:
            return (None,)
        return (id(trainer), str(trainer.state.fn), str(trainer.state.stage))

    def loss_func(self, output: Any, batch: Any) -> Any:
        """The loss of ``output``: the output itself if it is a tensor, or its ``loss`` entry / attribute."""
        if self._seed.loss_func is not None:
            return self._seed.loss_func(output)
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, Mapping) and "loss" in output:
            return output["loss"]
        if getattr(output, "loss", None) is not None:
            return output.loss
        raise InputTypeError(
            f"{type(self).__name__}.loss_func cannot find a loss in a {type(output).__name__}; override loss_func"
        )

    def sharding_target(self) -> nn.Module:
        """The module the FSDP2 config's paths are relative to (``MMFSDP2Strategy`` asks): ``self.model``."""
        if self.model is None:
            raise StateError("MMLightningModule.model_provider() did not build a model (self.model is None)")
        return self.model

    # ------------------------------------------------------------------------ context parallelism
    handles_context_parallel: bool = False
    """``True``: this module's model runs its own attention context-parallel (with the helpers of
    ``lightning_mm.core.context_parallel``) instead of the strategy routing a Transformers model's."""

    @property
    def context_parallel_group(self) -> Any:
        """The process group of this rank's context-parallel group (``MMFSDP2Strategy(context_parallel_size=C)``),
        ``None`` without context parallelism: pass it to ``split_sequence``, ``ulysses_attention`` and
        ``context_parallel_loss``."""
        trainer = attached_trainer(self)
        return getattr(trainer.strategy, "context_parallel_group", None) if trainer is not None else None

    # ------------------------------------------------------------------------ Lightning wiring
    def configure_model(self) -> None:
        if self.model is None:
            model = self.model_provider()
            if not isinstance(model, nn.Module):
                raise InputTypeError(f"model_provider() must return an nn.Module, got {type(model).__name__}")
            if self.enable_chunk_loss:
                from lightning_mm.hf.chunk_loss import chunk_loss_target, enable_chunk_loss

                enable_chunk_loss(chunk_loss_target(model), self.chunk_loss_size)
            self.model = model

    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """get_batch -> forward_step -> loss (either form): the loss tensor and extra values to log (what each
        training, validation and test step runs)."""
        if self._seed.forward_step is not None:
            inputs = batch  # MindSpeed MM's forward_step calls its own get_batch on the iterator
        else:
            inputs = self.get_batch(batch)
        output = self.forward_step(inputs)
        if isinstance(output, tuple) and len(output) == 2 and callable(output[1]):
            output, loss_fn = output
            result = loss_fn(output)
        else:
            result = self.loss_func(output, inputs)
        return _split_loss(result, type(self).__name__)

    def _log_step(self, stage: str, loss: torch.Tensor, extras: Mapping[str, Any], batch: Any) -> None:
        size = _batch_size(batch)
        on_step = stage == "train"
        self.log(
            f"{stage}/loss",
            loss.detach().float(),
            prog_bar=True,
            sync_dist=True,
            batch_size=size,
            on_step=on_step,
            on_epoch=not on_step,
        )
        for key, value in extras.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().float()
            self.log(f"{stage}/{key}", value, sync_dist=True, batch_size=size, on_step=on_step, on_epoch=not on_step)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, extras = self.compute_loss(batch)
        self._log_step("train", loss, extras, batch)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, extras = self.compute_loss(batch)
        self._log_step("val", loss, extras, batch)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, extras = self.compute_loss(batch)
        self._log_step("test", loss, extras, batch)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        inputs = batch if self._seed.forward_step is not None else self.get_batch(batch)
        output = self.forward_step(inputs)
        return output[0] if isinstance(output, tuple) and len(output) == 2 and callable(output[1]) else output

    # ------------------------------------------------------------------------ metrics
    def configure_callbacks(self) -> list[L.Callback]:
        """Lightning's ``ThroughputMonitor``, averaging over the steps between two written logs."""
        attached = attached_trainer(self)
        if not self.log_throughput or attached is None:
            return []
        # Lightning's connectors set `callbacks` and `log_every_n_steps` on the Trainer, which declares neither.
        trainer: Any = attached
        if any(isinstance(callback, ThroughputMonitor) for callback in trainer.callbacks):
            return []  # the user's own
        window = max(2, int(trainer.log_every_n_steps) * int(trainer.accumulate_grad_batches))  # batches, not steps
        return [
            MMThroughputMonitor(
                batch_size_fn=_samples, length_fn=_items, window_size=window, peak_tflops=self.peak_tflops
            )
        ]

    def step_flops(self, batch: Any) -> StepFlops | None:
        """The FLOPs of a training step over ``batch`` (:class:`~lightning_mm.hf.transformers_flops.FlopCounter`),
        ``None``
        for a model without a formula or a batch without ``input_ids``; sets ``flops_per_batch`` to its model FLOPs
        unless it was set otherwise."""
        counter = self._counter()
        if counter is None or not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
            return None
        flops = counter(batch)
        self.flops_per_batch = flops.model
        return flops

    def _counter(self) -> FlopCounter | None:
        if self._flop_counter is None:
            self._flop_counter = False
            owners = [c for c in type(self).__mro__ if "flops_per_batch" in vars(c)]
            if "flops_per_batch" in self.__dict__ or owners[0] is not MMLightningModule:  # the user's own
                return None
            model = self.model
            if model is not None and getattr(model, "config", None) is not None:
                try:
                    self._flop_counter = FlopCounter.from_model(model, *self._recomputed(model))
                except UnsupportedFlopsModel as error:
                    # a Transformers family without a formula is worth a warning; a model of the user's own is not
                    is_hf = isinstance(getattr(model.config, "model_type", None), str)
                    (rank_zero_warn if is_hf else rank_zero_info)(f"no FLOPs, TFLOP/s or MFU are logged: {error}")
        return self._flop_counter if isinstance(self._flop_counter, FlopCounter) else None

    def _recomputed(self, model: nn.Module) -> tuple[bool, bool, bool]:
        """Whether the language and vision blocks recompute (:func:`~lightning_mm.core.recompute.is_recomputed`,
        or Transformers' gradient checkpointing), and whether reentrantly (the strategy's ``use_reentrant``)."""
        checkpointing = getattr(model, "is_activation_checkpointing", None)
        if checkpointing is None:  # Transformers 5 before the rename (is_gradient_checkpointing is deprecated after it)
            checkpointing = getattr(model, "is_gradient_checkpointing", False)
        language = vision = bool(checkpointing)
        for name, module in model.named_modules():
            if is_recomputed(module):
                if ".visual." in f".{name}." or ".vision_" in f".{name}":
                    vision = True
                else:
                    language = True
        trainer = attached_trainer(self)
        config = getattr(getattr(trainer, "strategy", None), "fsdp2_config", None) if trainer is not None else None
        reentrant = bool(getattr(config, "use_reentrant", False)) if (language or vision) else False
        return language, vision, reentrant

    def _writes_step_logs(self) -> bool:
        """Whether Lightning writes this training step's logs (every ``Trainer(log_every_n_steps)`` steps).

        The gradient norm is computed and synchronised only on those steps: on the others nothing would read it,
        and its reduction costs a few per cent of a small model's step (benchmarks/README.md).
        """
        trainer = attached_trainer(self)
        return should_update_logs(trainer) if trainer is not None else True

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        optimizers = self.trainer.optimizers
        if optimizers:  # no collective: every step
            self.log(
                "train/lr",
                float(optimizers[0].param_groups[0]["lr"]),
                batch_size=_batch_size(batch),
                rank_zero_only=True,
            )

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.log_grad_norm and self._writes_step_logs():
            plugin = self.trainer.precision_plugin
            if isinstance(plugin, MMFSDP2Precision):  # computed once, shared with norm clipping
                norm = plugin.grad_norm(optimizer)
            else:
                norm = total_grad_norm([p for g in optimizer.param_groups for p in g["params"]])
            self.log("train/grad_norm", float(norm), rank_zero_only=True)  # identical on every rank

    # ------------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise ConfigError(f"{type(self).__name__} has no trainable parameters")
        # Sharded and unsharded (ignored-module) parameters in groups of their own: each group can take the fused step.
        optimizer = torch.optim.AdamW(
            group_by_sharding(params), lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps
        )
        if self.warmup_steps == 0 and self.lr_decay_style == "constant":
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _lr_factor(self, step: int) -> float:
        total = int(self.trainer.estimated_stepping_batches)
        return lr_factor(step, self.warmup_steps, total, self.lr_decay_style, self.min_lr / self.lr)


def _split_loss(result: Any, owner: str) -> tuple[torch.Tensor, dict[str, Any]]:
    extras: dict[str, Any] = {}
    if isinstance(result, tuple):  # (loss, {extras}) as MindSpeed loss functions often return
        if len(result) != 2 or not isinstance(result[1], Mapping):
            raise InputTypeError(f"{owner}: a loss tuple must be (loss, {{name: value}}), got {len(result)} items")
        result, extras = result[0], dict(result[1])
    if isinstance(result, Mapping):
        if "loss" not in result:
            raise InputKeyError(f"{owner}: a loss mapping must have a 'loss' key, got {sorted(result)}")
        extras.update({k: v for k, v in result.items() if k != "loss"})
        result = result["loss"]
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        raise InputTypeError(f"{owner}: the loss must be a scalar tensor, got {type(result).__name__}")
    return result, extras


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return None
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _batch_size(batch: Any) -> int | None:
    tensor = _first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.ndim > 0 else None


def _token_count(batch: Any) -> int | None:
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        return None
    mask = batch.get("attention_mask")
    return int(mask.sum()) if isinstance(mask, torch.Tensor) else int(batch["input_ids"].numel())


def _samples(batch: Any) -> int:
    """ThroughputMonitor's batch size: the first tensor's leading dimension (1 for a batch without tensors)."""
    return _batch_size(batch) or 1


def _items(batch: Any) -> int:
    """ThroughputMonitor's items: the batch's tokens, or one per sample when it has no ``input_ids``.

    (The monitor needs at least one item per sample: a batch of empty sequences still counts its samples.)
    """
    return max(_token_count(batch) or 0, _samples(batch))
