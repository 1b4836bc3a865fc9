"""What runs when ``Trainer.fit/validate/test/predict`` starts, before the other ranks or any work: the check of
``ckpt_path="last"``.

Lightning resolves ``ckpt_path="last"`` to the newest ``last*.ckpt`` of the ModelCheckpoint directories (and the
``OnExceptionCheckpoint`` path). When none exists it warns and starts from scratch, which is right before the first
run. A ``last`` link whose checkpoint was deleted is another matter: Lightning cannot follow it, warns the same
way, and a resumed run silently trains from step 0. :func:`dangling_last_link` finds that case; the launchers here
refuse it in one line (:class:`~lightning_mm.checkpoint.checkpoint_errors.CheckpointNotFoundError`) before anything
starts.

Lightning calls ``strategy.launcher.launch(trainer_fn, *args, trainer=...)`` first in each of those calls, with
``ckpt_path`` among the arguments, which is the only place where the value given by the user can be seen. The
launching rank gets Lightning's subprocess launcher with the check in front; a rank started by a launcher (or a
one-process run under torchrun/SLURM) gets :class:`CheckingLauncher`, which checks and calls the function, as
Lightning does without a launcher.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from typing_extensions import override

from lightning_mm._compat import _Launcher, _SubprocessScriptLauncher, last_checkpoints
from lightning_mm.checkpoint.checkpoint_errors import CheckpointNotFoundError
from lightning_mm.checkpoint.remote import is_url
from lightning_mm.errors import ConfigError

__all__ = [
    "dangling_last_link",
    "check_ckpt_path",
    "CheckingLauncher",
    "CheckingSubprocessScriptLauncher",
    "checking_launcher",
]


def dangling_last_link(trainer: pl.Trainer) -> str | None:
    """The one-line refusal for ``ckpt_path="last"`` when a ``last`` candidate is a link whose target is gone."""
    candidates: set[str] = {
        str(cb.ckpt_path)
        # Lightning's callback connector sets Trainer.callbacks; the Trainer class does not declare it
        for cb in trainer.callbacks  # type: ignore[attr-defined]
        if isinstance(cb, OnExceptionCheckpoint) and getattr(cb, "ckpt_path", None)
    }
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= last_checkpoints(callback, trainer)
    for candidate in sorted(candidates):
        link = Path(candidate)
        if link.is_symlink() and not link.exists():
            target = os.readlink(link)
            resolved = link.parent / target
            return (
                f'ckpt_path="last": {link} is a link to {target} ({resolved}), which does not exist (deleted?); '
                "restore that checkpoint, delete the link to start from scratch, or pass "
                "ckpt_path=<a checkpoint path>"
            )
    return None


def check_ckpt_path(function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None) -> None:
    """Refuse ``ckpt_path="last"`` over a dangling ``last`` link (``function``: the Trainer's ``_fit_impl`` & co)."""
    if trainer is None:
        return
    try:
        ckpt_path = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return
    if ckpt_path == "last":
        remote = sorted(
            str(cb.dirpath)
            for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and is_url(str(cb.dirpath))
        )
        if remote:
            raise ConfigError(
                f'ckpt_path="last" with ModelCheckpoint(dirpath={remote[0]!r}): Lightning looks for '
                f'"last" on local paths only; pass the URL itself, ckpt_path="{remote[0]}/last.ckpt"'
            )
        message = dangling_last_link(trainer)
        if message is not None:
            raise CheckpointNotFoundError(message)


class CheckingSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, after :func:`check_ckpt_path` (so no rank starts for a refused call)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        check_ckpt_path(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class CheckingLauncher(_Launcher):
    """No processes to start: :func:`check_ckpt_path`, then the function (what Lightning does without a launcher)."""

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        check_ckpt_path(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """No processes of its own to signal."""


def checking_launcher(env: ClusterEnvironment, num_processes: int, num_nodes: int) -> _Launcher:
    """The launcher of a strategy on ``env``: Lightning's subprocess launcher with the ``ckpt_path`` check in front
    when this process starts the other ranks, else :class:`CheckingLauncher`."""
    if not env.creates_processes_externally:
        return CheckingSubprocessScriptLauncher(env, num_processes, num_nodes)
    return CheckingLauncher()
