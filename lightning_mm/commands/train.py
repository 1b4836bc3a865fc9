"""``lightning-mm fit|validate|test|predict``: LightningCLI over MMLightningModule / MMDataModule subclasses.

One change from LightningCLI: a checkpoint never decides what is imported. LightningCLI reads the
``hyper_parameters`` of a ``--ckpt_path`` file and parses them as config, so a checkpoint could name any class
(``_class_path``) or function (a callable given by import path) and have it imported. Here class paths come only
from the config and the command line; the checkpoint's hyperparameters are data, compared with the config: another
model class is an error, other values are a warning (the config's values are used).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI

from lightning_mm._names import listing
from lightning_mm.errors import ConfigError

__all__ = ["MMLightningCLI", "run_lightning_cli", "checkpoint_hyperparameters", "compare_hyperparameters"]

_META_FILE = "meta.pt"  # a torch_dcp checkpoint directory keeps its hyperparameters here
_SHOWN = 8


def checkpoint_hyperparameters(ckpt_path: str | Path) -> dict[str, Any] | None:
    """The ``hyper_parameters`` of a checkpoint file or torch_dcp directory, read ``weights_only`` (no import).

    ``None`` when there is nothing to read (no such file: the Trainer reports a missing checkpoint itself).
    """
    import torch

    path = Path(ckpt_path)
    target = path / _META_FILE if path.is_dir() else path
    if not target.is_file():
        return None
    try:
        try:  # memory-mapped: only the pickled metadata is read, not a consolidated checkpoint's tensors
            checkpoint = torch.load(target, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            checkpoint = torch.load(target, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except Exception as error:  # not loadable weights_only: a tampered or foreign file
        text = str(error)
        if "Weights only load failed" in text:  # torch's long message: keep only the reason
            reason = text.split("trusted source.", 1)[-1].split("Check the documentation")[0]
            reason = reason.split("WeightsUnpickler error:", 1)[-1]
            text = " ".join(reason.split()) or text
        raise ConfigError(f"cannot read checkpoint {target} safely (weights_only): {text}") from error
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    return dict(hparams) if isinstance(hparams, Mapping) else None


def _plain(value: Any) -> Any:
    """A config value as YAML-like data, for comparison (Namespace -> dict, Path -> str, tuple -> list)."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if k != "__path__"}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if callable(value) and hasattr(value, "__qualname__"):  # a function or class given by import path
        return f"{value.__module__}.{value.__qualname__}"
    return value


def compare_hyperparameters(hparams: Mapping[str, Any], model_config: Mapping[str, Any], ckpt_path: str) -> list[str]:
    """Differences between a checkpoint's hyperparameters and the config's model (``class_path``/``init_args``).

    Raises :class:`ConfigError` when the checkpoint was saved from another model class; returns one line per other
    difference (the config's values are the ones used).
    """
    model = _plain(model_config)
    hparams = {k: v for k, v in _plain(dict(hparams)).items() if k not in ("_instantiator",)}
    saved_class = hparams.pop("_class_path", None)
    config_class = model.get("class_path") if isinstance(model, dict) else None
    if saved_class is not None and config_class is not None and saved_class != config_class:
        raise ConfigError(
            f"checkpoint {ckpt_path} was saved from model class {saved_class!r}, but the config builds "
            f"{config_class!r}; set model.class_path in the config (a checkpoint never chooses what is imported)"
        )
    init_args: dict[str, Any] = {}
    if isinstance(model, dict):
        init_args = {**(model.get("init_args") or {}), **(model.get("dict_kwargs") or {})}
    lines = []
    for key, saved in hparams.items():
        if key not in init_args:
            lines.append(f"{key}: {saved!r} in the checkpoint, not an argument in the config")
        elif init_args[key] != saved:
            lines.append(f"{key}: {saved!r} in the checkpoint, {init_args[key]!r} in the config")
    return lines


class MMLightningCLI(LightningCLI):
    """LightningCLI that reads a checkpoint's hyperparameters as data instead of parsing (and importing) them.

    It also shows the validation metrics on the progress bar (``lightning_mm.commands.progress``) unless the
    config adds its own progress bar or turns it off.
    """

    _held_ckpt_path: str | None = None

    def parse_arguments(self, parser: Any, args: Any) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI would now parse the checkpoint's hyperparameters into the config (importing any class or
        # function they name). Hold the path back until that step has passed; before_instantiate_classes restores it.
        subcommand = self.config.get("subcommand")
        if subcommand and self.config[subcommand].get("ckpt_path"):
            self._held_ckpt_path = str(self.config[subcommand]["ckpt_path"])
            self.config[subcommand]["ckpt_path"] = None

    def before_instantiate_classes(self) -> None:
        subcommand = self.config.get("subcommand")
        if not subcommand or self._held_ckpt_path is None:
            return
        self.config[subcommand]["ckpt_path"] = self._held_ckpt_path
        hparams = checkpoint_hyperparameters(self._held_ckpt_path)
        if hparams:
            differences = compare_hyperparameters(hparams, self.config[subcommand]["model"], self._held_ckpt_path)
            if differences:
                from lightning.pytorch.utilities import rank_zero_warn

                shown = listing(differences, _SHOWN, sep="\n  ")
                rank_zero_warn(
                    f"the hyperparameters of {self._held_ckpt_path} differ from the config; the config's "
                    f"are used:\n  {shown}"
                )

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        from lightning.pytorch.callbacks import ProgressBar

        from lightning_mm.commands.progress import default_progress_bar

        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_config = config.get("trainer") or {}
        callbacks = list(kwargs.get("callbacks", trainer_config.get("callbacks") or []))
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            kwargs["callbacks"] = [*callbacks, default_progress_bar()]
        return super().instantiate_trainer(**kwargs)


def run_lightning_cli(argv: Sequence[str]) -> None:
    """Run ``fit|validate|test|predict`` with the given arguments."""
    import lightning_mm
    from lightning_mm.commands.noise import quiet_library_noise

    lightning_mm.register()
    quiet_library_noise()
    from lightning_mm import MMDataModule, MMLightningModule

    MMLightningCLI(
        MMLightningModule,
        MMDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=None if list(argv) == sys.argv[1:] else list(argv),  # LightningCLI warns when given both
        save_config_kwargs={"overwrite": True},
    )
