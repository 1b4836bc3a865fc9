"""The strategy's checkpoint entry points: save, load, remove, and the RNG of a resumed run.

``MMFSDP2Strategy.save_checkpoint`` / ``load_checkpoint`` / ``remove_checkpoint`` and the state-dict hooks call
:class:`StrategyCheckpoints`, which holds the checkpoint options (format, Hugging Face weights and their dtype,
storage options of URLs, background saving) and the state between calls (the save being written in the
background, the RNG state a resumed run restores before its next batch). The formats themselves are objects of
one interface (:class:`lightning_mm.checkpoint.CheckpointFormat`: write, read, recognise), looked up by name in the
checkpoint I/O's registry: ``torch_dcp`` directories or consolidated ``torch`` files (:mod:`lightning_mm.checkpoint`),
written atomically, loaded strictly (keys listed) and safely (``weights_only``), resharded to any world size; remote
ones through :mod:`lightning_mm.checkpoint.remote`; Hugging Face weights (``hf``, ``torch_dcp+hf``) through
:mod:`lightning_mm.hf.checkpoint_format`, registered by :mod:`lightning_mm.hf`. Nothing here names a format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lightning_mm.hf  # noqa: F401 - registers the `hf` and `lora` checkpoint records and the `hf` formats
from lightning_mm import checkpoint as ckpt
from lightning_mm._compat import attached_trainer
from lightning_mm.checkpoint import CheckpointFormat, hf_weights
from lightning_mm.errors import ConfigError, InputTypeError
from lightning_mm.strategies.async_save import AsyncSaver

if TYPE_CHECKING:
    from datetime import timedelta

    import torch
    from lightning.pytorch.core.optimizer import LRSchedulerConfig
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

    from lightning_mm.core.sharded_run import ShardedRun

__all__ = ["CHECKPOINT_FORMATS", "ResumeRNG", "ShardedStrategy", "StrategyCheckpoints"]

CHECKPOINT_FORMATS = ckpt.format_names()
"""The values of ``MMFSDP2Strategy(checkpoint_format=...)`` (the registered formats)."""


class ShardedStrategy(Protocol):
    """What the checkpoint entry points read from the strategy (``MMFSDP2Strategy``)."""

    @property
    def lightning_module(self) -> Any: ...
    @property
    def world_size(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def device_mesh(self) -> DeviceMesh: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def optimizers(self) -> list[Optimizer]: ...
    @property
    def lr_scheduler_configs(self) -> list[LRSchedulerConfig]: ...
    def lightning_module_state_dict(self) -> dict[str, Any]: ...

    timeout: timedelta | None
    sharded_run: ShardedRun


class ResumeRNG:
    """The per-rank RNG state of a loaded checkpoint, restored exactly once, right before training continues:
    before the next batch (``rng_point: next_batch``) or before the next epoch's data iterator (``next_epoch``),
    and only for the step right after the checkpoint (never into a later, unrelated run)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        self.point: str | None = None
        self.step: int | None = None

    def hold(self, state: dict[str, Any] | None, point: str | None, step: int | None) -> None:
        self.state, self.point, self.step = state, point, step

    @property
    def pending(self) -> bool:
        return self.state is not None

    def restore(self, global_step: int | None, device: Any) -> None:
        """Restore the held state if ``global_step`` (``None``: no trainer) is the checkpoint's; forget it."""
        if self.state is not None and (global_step is None or global_step == self.step):
            ckpt.restore_rng(self.state, device)
        self.state = self.point = None


class StrategyCheckpoints:
    """Checkpoint options and state of one ``MMFSDP2Strategy`` (see the module docstring and the strategy's
    arguments of the same names)."""

    def __init__(
        self,
        checkpoint_format: str,
        save_ckpt_dtype: str | None,
        storage_options: Mapping[str, Any] | None,
        async_save: bool,
        strict_loading: bool | None,
    ) -> None:
        self.checkpoint_format = checkpoint_format
        hf_weights.check_dtype(save_ckpt_dtype)
        if save_ckpt_dtype is not None and not self.format.casts_weights:
            casting = " or ".join(repr(n) for n in ckpt.format_names() if ckpt.checkpoint_format(n).casts_weights)
            raise ConfigError(
                f"save_ckpt_dtype={save_ckpt_dtype!r} casts the Hugging Face weights of a checkpoint: it needs "
                f"checkpoint_format {casting}, not {checkpoint_format!r}"
            )
        self.save_ckpt_dtype = save_ckpt_dtype
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise InputTypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self.storage_options = dict(storage_options) if storage_options is not None else None
        if not isinstance(async_save, bool):
            raise InputTypeError(f"async_save must be True or False, got {async_save!r}")
        if async_save and not self.format.in_background:
            raise ConfigError(
                f"async_save=True cannot write checkpoint_format={checkpoint_format!r} in the background (its Hugging "
                "Face weights are read from the live model); use 'torch_dcp' or 'torch'"
            )
        self.async_save = async_save
        self.strict_loading = strict_loading
        self.saver = AsyncSaver()
        """The save being written in the background (``async_save=True``)."""
        self.resume_rng = ResumeRNG()
        self._warned_async_url = False

    @property
    def checkpoint_format(self) -> str:
        """The format of the next save (one of :data:`CHECKPOINT_FORMATS`)."""
        return self._format

    @checkpoint_format.setter
    def checkpoint_format(self, value: str) -> None:
        self.format = ckpt.checkpoint_format(value)  # a ValueError naming the formats for an unknown one
        self._format = value

    format: CheckpointFormat
    """The format object of :attr:`checkpoint_format`."""

    @property
    def full(self) -> bool:
        """Whether state dicts are gathered on rank 0 (``torch``) rather than kept as each rank's shards."""
        return self.format.full

    def check_call(self, io: CheckpointIO | None, weights_only: bool | None = None) -> None:
        """Before a save or load: the strategy writes its checkpoints itself (a CheckpointIO plugin other than
        Lightning's default cannot take part) and loads them ``weights_only``."""
        if io is not None and type(io) is not TorchCheckpointIO:
            raise InputTypeError(
                f"MMFSDP2Strategy writes its checkpoints itself (checkpoint_format={self.checkpoint_format!r}); the "
                f"{type(io).__name__} plugin cannot be used with it"
            )
        if weights_only is False:
            raise ConfigError(
                "MMFSDP2Strategy loads checkpoints weights_only (no pickled code is run); "
                "weights_only=False is not supported"
            )

    # ------------------------------------------------------------------------------------------ at setup
    def refuse_at_urls(self, callbacks: Sequence[Any], default_dir: Any = None) -> None:
        """At the start of a fit, before any process group or step: a checkpoint callback whose directory is a URL,
        with a ``checkpoint_format`` other than ``torch_dcp``, is refused, as its first save would refuse it. A
        callback without a ``dirpath`` has the one Lightning gives it under ``default_dir`` (the first logger's
        ``save_dir``, else the Trainer's ``default_root_dir``). ``save_last="link"`` at a URL is refused too (a
        :class:`~lightning_mm.errors.ConfigError` naming the key; object stores have no symbolic links), before
        Lightning's own ``ModelCheckpoint.setup`` would raise it with a traceback."""
        for callback in callbacks:
            dirpath = getattr(callback, "dirpath", None)
            where = dirpath if dirpath is not None else default_dir
            if not ckpt.remote.is_url(where):
                continue
            shown = f"dirpath={dirpath!r}" if dirpath is not None else f"under {where!r}"
            if getattr(callback, "save_last", None) == "link":
                raise ConfigError(
                    f"ModelCheckpoint({shown}): save_last='link' needs a local directory (an object store has no "
                    "symbolic links); use save_last: true"
                )
            self.format.refuse_url(f"ModelCheckpoint({shown})")

    def refuse_unsavable_model(self, strategy: ShardedStrategy) -> None:
        """At the setup of a fit, once the model is sharded: with Hugging Face weights in the format, a model they
        cannot be written for (LoRA adapters, several Transformers models, tensors outside the model, tensors that
        ``save_pretrained`` converts) is refused now, with the error its first save would raise. A format
        changed later, between saves, is checked when it is saved."""
        self.format.refuse_module(strategy.lightning_module, lambda: list(strategy.lightning_module_state_dict()))

    # ---------------------------------------------------------------------------------------------- save
    def save(
        self, strategy: ShardedStrategy, checkpoint: dict[str, Any], target: str, storage_options: Any | None
    ) -> None:
        """Write ``checkpoint`` at ``target`` (a path or URL, the same on every rank); visible once complete."""
        url = ckpt.remote.is_url(target)
        if storage_options is not None and not url:
            raise InputTypeError(
                "MMFSDP2Strategy writes its checkpoints itself; `storage_options` is only used for checkpoints at "
                "URLs (s3://...)"
            )
        self.wait()  # a second save waits for the first
        lm = strategy.lightning_module
        assert lm is not None
        path: Path | str = target if url else Path(target)
        extra = {
            "format_version": ckpt.FORMAT_VERSION,
            "kind": ckpt.KIND_TRAINING,
            "world_size": strategy.world_size,
            "mesh_shape": list(strategy.device_mesh.shape),
            "rng_point": _rng_point(lm),
            **ckpt.collect_records(lm),  # what other layers record (registered record providers)
        }
        if self.full and "optimizer_states" in checkpoint:  # what the indices stand for
            extra[ckpt.OPTIMIZER_NAMES_KEY] = ckpt.optimizer_param_names(lm, strategy.optimizers)
        rng = ckpt.capture_rng(strategy.root_device)
        fmt, dtype = self.format, self.save_ckpt_dtype
        if isinstance(path, str):  # a URL
            if self.async_save and not self._warned_async_url:
                self._warned_async_url = True
                rank_zero_warn(f"async_save: {path} is at a URL; checkpoints at URLs are written synchronously")
            options = storage_options if storage_options is not None else self.storage_options
            fmt.write(checkpoint, path, extra, rng, module=lm, dtype=dtype, storage_options=options)
        elif self.async_save and _fitting(lm):
            self.saver.start(
                path,
                strategy.is_global_zero,
                lambda executor, group, staging: fmt.write(
                    checkpoint,
                    path,
                    extra,
                    rng,
                    module=lm,
                    dtype=dtype,
                    background=executor,
                    group=group,
                    staging=staging,
                ),
                strategy.timeout,
            )
        else:
            fmt.write(checkpoint, path, extra, rng, module=lm, dtype=dtype)

    def wait(self) -> None:
        """Wait until the save written in the background is in place; raise what it raised (none: nothing)."""
        self.saver.wait()

    # ---------------------------------------------------------------------------------------------- load
    def load(self, strategy: ShardedStrategy, target: str) -> dict[str, Any]:
        """Load model and (when fitting) optimiser state in place, with strict key checks; return the rest and
        hold the per-rank RNG state for :meth:`restore_rng_before_batch` / :meth:`restore_rng_before_epoch`."""
        self.wait()
        lm = strategy.lightning_module
        assert lm is not None
        path: Path | str = target if ckpt.remote.is_url(target) else Path(target)
        fitting = lm.trainer.state.fn == TrainerFn.FITTING
        strict = lm.strict_loading if self.strict_loading is None else self.strict_loading
        loaded = ckpt.load(
            path,
            lm,
            strategy.optimizers if fitting else [],
            strict=strict,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            fitting=fitting,
            view=strategy.sharded_run.expert_view(lm, "model"),
            optimizer_view=strategy.sharded_run.expert_view(lm, "optimizer"),
            schedulers=[c.scheduler for c in strategy.lr_scheduler_configs],
            source=ckpt.remote.open_source(path, self.storage_options) if isinstance(path, str) else None,
        )
        self.resume_rng.hold(loaded.rng, loaded.rng_point, loaded.checkpoint.get("global_step"))
        return loaded.checkpoint

    def restore_rng_before_epoch(self, lm: Any, device: Any) -> None:
        """Resuming at an epoch boundary: restore the RNG before the new epoch's training iterator is created."""
        trainer = attached_trainer(lm)
        if (
            self.resume_rng.pending
            and self.resume_rng.point == "next_epoch"
            and trainer is not None
            and trainer.training
            and not trainer.sanity_checking
        ):
            self.resume_rng.restore(trainer.global_step, device)

    def restore_rng_before_batch(self, lm: Any, device: Any) -> None:
        """Resuming mid-epoch: restore the RNG right before the first batch after the checkpoint."""
        if self.resume_rng.pending:
            trainer = attached_trainer(lm)
            self.resume_rng.restore(trainer.global_step if trainer is not None else None, device)

    # -------------------------------------------------------------------------------------------- remove
    def remove(self, filepath: str) -> None:
        """Delete a checkpoint (call on rank 0): a directory is moved out of sight before it is deleted. While a
        save runs in the background, the deletion waits until it is complete."""
        if ckpt.remote.is_url(filepath):
            ckpt.remote.remove(filepath, self.storage_options)
        elif not self.saver.defer_removal(Path(filepath)):
            ckpt.remove(Path(filepath))

    def end(self, failed: bool, timeout: float) -> None:
        """At teardown: a failed run completes its background save if it can within ``timeout`` (else the partial
        checkpoint stays hidden); a successful one waits for it."""
        if failed:
            self.saver.settle(timeout)
        else:
            self.wait()


def _rng_point(lm: Any) -> str:
    """Where a resumed run restores the RNG: before the next batch, or before the next epoch's data iterator."""
    trainer = attached_trainer(lm)
    if trainer is None:
        return "next_batch"
    return "next_epoch" if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch else "next_batch"


def _fitting(lm: Any) -> bool:
    trainer = attached_trainer(lm)
    return (
        trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
    )
