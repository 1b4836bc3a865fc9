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

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI

from lightning_mm._utils.suggestions import listing
from lightning_mm.errors import ConfigError

__all__ = [
    "MMLightningCLI",
    "RecordModelIdentity",
    "run_lightning_cli",
    "checkpoint_hyperparameters",
    "checkpoint_metadata",
    "check_model_identity",
    "compare_hyperparameters",
    "model_identity",
]

_META_FILE = "meta.pt"  # a torch_dcp checkpoint directory keeps its hyperparameters here
_SHOWN = 8


def checkpoint_hyperparameters(ckpt_path: str | Path) -> dict[str, Any] | None:
    """The ``hyper_parameters`` of a checkpoint file or torch_dcp directory, read ``weights_only`` (no import).

    ``None`` when there is nothing to read (no such file: the Trainer reports a missing checkpoint itself).
    """
    checkpoint = checkpoint_metadata(ckpt_path)
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    return dict(hparams) if isinstance(hparams, Mapping) else None


def checkpoint_metadata(ckpt_path: str | Path) -> Mapping[str, Any] | None:
    """The non-tensor entries of a checkpoint file or torch_dcp directory (its ``meta.pt``), read ``weights_only``
    and memory-mapped (no import, no tensor read); ``None`` when there is no such file."""
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
    return checkpoint if isinstance(checkpoint, Mapping) else None


IDENTITY_KEY = "lightning_mm_model"
"""The checkpoint entry that records which model was trained (:func:`model_identity`)."""
_IDENTITY_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
)


def model_identity(model_config: Any) -> dict[str, Any] | None:
    """What makes a model this model, from its config alone (no import, no build): for a TransformersModel, the
    class and sizes of its ``init_from_hf_path`` config.json (``hf_config`` applied); ``None`` when the config does
    not say (a ``model_provider`` builds the model)."""
    import json

    model = _plain(model_config)
    if not isinstance(model, Mapping):
        return None
    args = model.get("init_args", model)
    transformers_model = args.get("transformers_model") if isinstance(args, Mapping) else None
    if not isinstance(transformers_model, Mapping) or not transformers_model.get("init_from_hf_path"):
        return None
    path = Path(str(transformers_model["init_from_hf_path"])) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    overrides = transformers_model.get("hf_config")
    if isinstance(overrides, Mapping):
        config.update(overrides)
    architectures = config.get("architectures") or [config.get("model_type")]
    identity: dict[str, Any] = {"class": str(architectures[0]), "model_type": config.get("model_type")}
    for section, prefix in (
        (config, ""),
        (config.get("text_config"), "text."),
        (config.get("vision_config"), "vision."),
    ):
        if isinstance(section, Mapping):
            identity.update({prefix + k: section[k] for k in _IDENTITY_SIZES if k in section})
    return identity


def describe_identity(identity: Mapping[str, Any], keys: Sequence[str] | None = None) -> str:
    """One model as a sentence names it: ``Qwen2ForCausalLM (num_hidden_layers 2, ...)``, with ``keys`` (default:
    every size) shown."""
    shown = [k for k in (keys if keys is not None else identity) if k not in ("class", "model_type")]
    sizes = ", ".join(f"{k} {identity.get(k, '-')}" for k in shown)
    return f"{identity.get('class')} ({sizes})" if sizes else str(identity.get("class"))


def check_model_identity(ckpt_path: str, checkpoint: Mapping[str, Any], model_config: Any) -> None:
    """A run never resumes another model's checkpoint: a :class:`ConfigError` naming both models when the identity
    recorded in the checkpoint (or read from its hyperparameters) differs from the config's model."""
    current = model_identity(model_config)
    saved = checkpoint.get(IDENTITY_KEY)
    if not isinstance(saved, Mapping):
        hparams = checkpoint.get("hyper_parameters")
        saved = model_identity(hparams) if isinstance(hparams, Mapping) else None
    if current is None or saved is None or dict(saved) == current:
        return
    differ = [k for k in {**saved, **current} if saved.get(k) != current.get(k)]
    raise ConfigError(
        f"checkpoint {ckpt_path} holds the weights of {describe_identity(saved, differ)}, but the config trains "
        f"{describe_identity(current, differ)}; a run never resumes another model's checkpoint: give this run its own "
        "checkpoint directory (ModelCheckpoint dirpath) or the checkpoint of this model"
    )


def resolve_ckpt_path(ckpt_path: str, trainer_config: Any) -> str | None:
    """The checkpoint ``ckpt_path`` names: ``last`` is the newest ``last*.ckpt`` of the config's ModelCheckpoint
    directories (as Lightning resolves it), a path is itself; ``None`` when there is none yet."""
    if ckpt_path != "last":
        return ckpt_path
    trainer_config = _plain(trainer_config)  # a jsonargparse Namespace in the CLI
    callbacks = (trainer_config.get("callbacks") if isinstance(trainer_config, Mapping) else None) or []
    found: list[Path] = []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        args = callback.get("init_args") if isinstance(callback, Mapping) else None
        if isinstance(args, Mapping) and args.get("dirpath") and "ModelCheckpoint" in str(callback.get("class_path")):
            found += [p for p in Path(str(args["dirpath"])).glob("last*.ckpt") if p.exists()]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


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


class RecordModelIdentity(Callback):
    """Writes the run's :func:`model_identity` under :data:`IDENTITY_KEY` in each checkpoint it saves, so that a
    resume can tell which model a checkpoint holds before any weight is read (``MMLightningCLI`` adds it)."""

    def __init__(self, identity: Mapping[str, Any]) -> None:
        self.identity = dict(identity)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[IDENTITY_KEY] = dict(self.identity)


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
        resolved = resolve_ckpt_path(self._held_ckpt_path, self.config[subcommand].get("trainer"))
        metadata = checkpoint_metadata(resolved) if resolved else None
        if metadata is not None and resolved is not None:  # before any weight is read
            check_model_identity(resolved, metadata, self.config[subcommand]["model"])
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
        identity = model_identity((self.config[self.subcommand] if self.subcommand else self.config).get("model"))
        if identity is not None:
            callbacks.append(RecordModelIdentity(identity))
            kwargs["callbacks"] = callbacks
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
