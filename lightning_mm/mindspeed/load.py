"""The one entry to MindSpeed MM's files: :func:`detect` names a file's format, and each user of a config reads it
through here (``MMFSDP2Strategy(fsdp2_config=...)`` -> :func:`fsdp2_config`; ``MMDataModule(data_config=...)`` ->
:func:`data_file_format`; ``lightning-mm migrate`` -> :func:`migrate_file` / :func:`migrate_flags`;
``lightning-mm plan`` -> :func:`require_lightning_mm_config`, then through the strategy).

The formats: this project's own YAML (``lightning-mm``), MindSpeed MM's native-route six-section YAML or its
``parallel:`` section (``native``), its single YAML (``single-yaml``: ``gpt_args``), the Megatron route's component
configs (``model``: a model.json; ``data``: a data config; ``fsdp2`` / ``layerzero``: a sharding config) and a
launch script (``launch-script``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_mm.core.config import FSDP2Config
from lightning_mm.errors import MissingFileError
from lightning_mm.mindspeed.keys import MindSpeedConfigError

if TYPE_CHECKING:
    from lightning_mm.mindspeed.report import MigrationReport

__all__ = [
    "Format",
    "data_section",
    "data_file_format",
    "detect",
    "fsdp2_config",
    "migrate_file",
    "migrate_flags",
    "require_lightning_mm_config",
]

Format = Literal["lightning-mm", "native", "native-parallel", "single-yaml", "model", "data", "fsdp2", "layerzero"]
"""The format of a config's content (a launch script is told by its file name: not YAML nor JSON)."""

_DATA_KEYS = ("dataset_param", "dataloader_param")
_MODEL_KEYS = (
    "model_id",
    "init_from_hf_path",
    "predictor",
    "ae",
    "text_encoder",
    "image_encoder",
    "text_decoder",
    "diffusion",
)
_FSDP2_KEYS = ("sub_modules_to_wrap", "sharding_size", "param_dtype", "reduce_dtype", "recompute_modules")
_LAYERZERO_KEYS = ("zero3_size", "transformer_layers")
_COMPONENTS: tuple[tuple[tuple[str, ...], Format], ...] = (
    (_DATA_KEYS, "data"),
    (_MODEL_KEYS, "model"),
    (_LAYERZERO_KEYS, "layerzero"),
    (_FSDP2_KEYS, "fsdp2"),
)


def detect(content: Mapping[str, Any]) -> Format:
    """The format of a config's top-level mapping; ``lightning-mm`` when it has no MindSpeed MM key."""
    from lightning_mm.mindspeed.native_parallel import native_layout

    if "gpt_args" in content:
        return "single-yaml"
    if native_layout(content) == "config":
        return "native"
    for keys, name in _COMPONENTS:
        if any(k in content for k in keys):
            return name
    if native_layout(content) == "parallel":
        return "native-parallel"
    return "lightning-mm"


def data_section(content: Mapping[str, Any]) -> tuple[Mapping[str, Any], str] | None:
    """A MindSpeed MM data config's section (``dataset_param`` / ``dataloader_param`` at the top, or under
    ``data:`` as in the single YAML and the native route's YAML) and its key prefix; None for this project's own
    data config."""
    if any(k in content for k in _DATA_KEYS):
        return content, ""
    inner = content.get("data")
    if isinstance(inner, Mapping) and any(k in inner for k in _DATA_KEYS):
        return inner, "data."
    return None


def data_file_format(path: str | os.PathLike, error: type[Exception]) -> Literal["mindspeed", "lightning-mm"]:
    """``MMDataModule(data_config=path)``: a MindSpeed MM data config (see :func:`data_section`) or this project's
    own; a file that is not YAML with a mapping at the top is ``error`` naming it."""
    from lightning_mm._utils.yaml_io import load_mapping

    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"data config not found: {path}")
    return "mindspeed" if data_section(load_mapping(path, error=error)) is not None else "lightning-mm"


def require_lightning_mm_config(path: str | os.PathLike, command: str) -> None:
    """``lightning-mm <command> --config path``: a file of MindSpeed MM's (a launch script, its single or
    native-route YAML, a component config) is an error telling to migrate it first; this project's own config, or a
    file that cannot be read here, is left to LightningCLI."""
    from lightning_mm._utils.yaml_io import load_mapping

    path = Path(path)
    if not path.is_file():
        return
    if path.suffix.lower() == ".sh":
        kind = "launch script"
    elif is_launch_script(path):
        return
    else:
        try:
            kind = detect(load_mapping(path, error=MindSpeedConfigError))
        except MindSpeedConfigError:
            return  # LightningCLI names what is wrong with it
        if kind in ("lightning-mm", "fsdp2"):  # an FSDP2 YAML is this project's format too
            return
    raise MindSpeedConfigError(
        f"{path} is a MindSpeed MM {kind} file, not a lightning-mm config; turn it into one with "
        f"`lightning-mm migrate {path} -o config.yaml`, then `lightning-mm {command} --config config.yaml`"
    )


def is_launch_script(path: Path) -> bool:
    """A launch script: any file that is not a YAML or JSON config."""
    return Path(path).suffix.lower() not in (".yaml", ".yml", ".json")


def fsdp2_config(value: FSDP2Config | Mapping[str, Any] | str | os.PathLike | None) -> FSDP2Config:
    """``MMFSDP2Strategy(fsdp2_config=...)``: this project's FSDP2 config (a config, a dict, a YAML path; ``None``
    is the defaults) or MindSpeed MM's native ``parallel:`` section, whole native config or its file
    (:func:`~lightning_mm.mindspeed.native_parallel.fsdp2_config_from_native`)."""
    from lightning_mm._utils.yaml_io import load_mapping
    from lightning_mm.core.config import FSDP2ConfigError
    from lightning_mm.mindspeed.native_parallel import fsdp2_config_from_native, native_layout

    source: str | None = None
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if not path.is_file():
            raise MissingFileError(f"FSDP2 config file not found: {path}")
        value, source = load_mapping(path, error=FSDP2ConfigError), str(path)
    if isinstance(value, Mapping) and native_layout(value) is not None:
        return fsdp2_config_from_native(value, source)
    if isinstance(value, Mapping) and source is not None:
        return FSDP2Config.from_dict(value, source=source)
    return FSDP2Config.load(value)


def migrate_file(
    path: Path,
    base_dir: Path | None = None,
    import_root: Path | None = None,
    keep_backend: bool = False,
    hf_path: Path | None = None,
    world_size: int | None = None,
) -> tuple[MigrationReport, list[Path]]:
    """``lightning-mm migrate FILE``: the migration of a launch script, a single or native-route YAML, or one of
    MindSpeed MM's component configs given by itself (a model.json, a data config, an FSDP2 YAML), and the files it
    read. A file of a kind this project does not train is a :class:`~lightning_mm.mindspeed.refusals.Refused`
    error naming the file and the reason (:data:`~lightning_mm.mindspeed.refusals.REASONS`).

    ``world_size`` (``--world-size``: the launch's NPUs x nodes) records a native-route config's global batch
    size when the launch line does not give it (a YAML given by itself, or a script whose counts are shell)."""
    from lightning_mm.mindspeed.files import load_config_file
    from lightning_mm.mindspeed.launch_kinds import refuse_model_ids, refuse_yaml
    from lightning_mm.mindspeed.launch_route import migrate_script
    from lightning_mm.mindspeed.launch_script import Launch
    from lightning_mm.mindspeed.megatron_route import migrate, migrate_yaml
    from lightning_mm.mindspeed.native_route import migrate_native

    path = Path(path)
    source = str(path)
    inputs = [path]
    result: MigrationReport
    if not is_launch_script(path):
        base = Path(base_dir) if base_dir else Path.cwd()
        content = load_config_file(path)
        refuse_yaml(content, source)
        absolute = str(path.resolve())
        kind = detect(content)
        if kind == "native":  # MindSpeed MM's native FSDP2 route: six sections, parallel first
            refuse_model_ids(content, source, ("model",))
            result = migrate_native(path, content, base_dir=base, world_size=world_size)
        elif kind == "single-yaml":
            refuse_model_ids(content, source, ("model",))
            result = migrate_yaml(path, base_dir=base, keep_backend=keep_backend)
        elif kind == "data":
            result = migrate(Launch(flags=[("--mm-data", absolute)]), base_dir=base)
        elif kind == "model":
            refuse_model_ids(content, source)
            result = migrate(Launch(flags=[("--mm-model", absolute)]), base_dir=base, hf_path=hf_path)
        elif kind in ("fsdp2", "layerzero"):
            flag = "--layerzero-config" if kind == "layerzero" else "--fsdp2-config-path"
            result = migrate(Launch(flags=[("--use-torch-fsdp2", None), (flag, absolute)]), base_dir=base)
        else:
            raise MindSpeedConfigError(
                f"{path}: not a MindSpeed MM launch script, single YAML, native-route YAML, model config, data "
                "config or FSDP2 config (none of their keys: gpt_args, parallel, model_id, dataset_param, "
                "sub_modules_to_wrap, ...)"
            )
        result.notes.insert(0, f"relative paths are taken from {base.resolve()} (the launch directory; --base-dir)")
        _world_size_used(result, world_size, path)
        return result, inputs
    result, read = migrate_script(path, base_dir, import_root, keep_backend, hf_path, world_size)
    _world_size_used(result, world_size, path)
    return result, inputs + read


def _world_size_used(result: MigrationReport, world_size: int | None, path: Path) -> None:
    """``--world-size`` is for the native route; elsewhere it would be ignored, so it is refused."""
    if world_size is not None and result.route == "megatron":
        raise MindSpeedConfigError(
            f"{path}: --world-size is read for a native-route config only; a Megatron-route launch's process "
            "counts come from its torchrun line (trainer.devices, trainer.num_nodes)"
        )


def migrate_flags(
    flags: Sequence[str],
    base_dir: Path | None = None,
    import_root: Path | None = None,
    keep_backend: bool = False,
    hf_path: Path | None = None,
) -> MigrationReport:
    """``lightning-mm migrate -- FLAGS``: training flags given on the command line (the Megatron route)."""
    from lightning_mm.mindspeed.launch_script import parse_args
    from lightning_mm.mindspeed.megatron_route import migrate

    return migrate(
        parse_args(flags), base_dir=base_dir, import_root=import_root, keep_backend=keep_backend, hf_path=hf_path
    )
