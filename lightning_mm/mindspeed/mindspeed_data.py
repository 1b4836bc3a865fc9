"""MindSpeed MM data configs (``dataset_param`` + ``dataloader_param``): layout detection, the loader settings, and
the ``dataset_type: huggingface`` datasets built with the model's own processor.

A file is a MindSpeed MM data config when its top level has ``dataset_param`` or ``dataloader_param`` (its
``data.json``), or when it has a ``data:`` mapping that does (its single-YAML launch file; the other sections of such
a file are not read here). Anything else is the native layout (:mod:`lightning_mm.data.data_config`).

Relative paths resolve as MindSpeed MM resolves them: against the current working directory (its examples run from
the repository root), taken when the data module is built. That holds for ``model_name_or_path``, ``dataset``,
``val_dataset`` and ``dataset_dir``; media paths of a record are relative to ``dataset_dir`` and must resolve
(symlinks followed) inside it, unless the data section sets ``allow_outside_data_root: true`` (then a media file
not under ``dataset_dir`` is taken as written, relative to the working directory, as MindSpeed MM falls back to).
Two keys of this project may sit next to ``dataset_param``: ``strict`` and ``allow_outside_data_root``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mm._utils.distributed import rank_zero_info
from lightning_mm._utils.yaml_io import load_mapping, short_repr
from lightning_mm.data.data_config import DataConfigError
from lightning_mm.data.record_files import DataReport
from lightning_mm.errors import MissingFileError
from lightning_mm.mindspeed.data_keys import check_keys, strict_or_warn
from lightning_mm.mindspeed.keys import KeyReader

__all__ = ["MindSpeedDataConfig", "read_data_file", "parse_section", "build_datasets"]

_SECTION_KEYS = ("dataset_param", "dataloader_param", "val_dataset_param", "strict", "allow_outside_data_root")
_DATASET_KEYS = ("dataset_type", "preprocess_parameters", "basic_parameters", "attr")
_LOADER_KEYS = (
    "dataloader_mode",
    "drop_last",
    "sampler_type",
    "collate_param",
    "pin_memory",
    "shuffle",
    "num_workers",
    "enable_preload",
    "group_frame",
    "group_resolution",
    "group_data",
    "initial_global_step_for_sampler",
)
_COLLATE_KEYS = ("model_name", "collator_id", "ignore_pad_token_for_loss", "pad_to_multiple_of")
_LAUNCH_FLAGS = {
    "batch_size": "micro_batch_size (MMDataModule(batch_size=...))",
    "seed": "seed (MMDataModule(seed=...))",
}
_UNSUPPORTED_LOADER = ("prefetch_factor", "persistent_workers", "data_sharding", "priority_mode")
_SAMPLERS = ("BaseRandomBatchSampler", "stateful_distributed_sampler", "LengthGroupedSampler")


@dataclass(frozen=True)
class MindSpeedDataConfig:
    """A MindSpeed MM data section, checked at the dataloader level; ``dataset_param`` is checked by its builder."""

    dataset_type: str
    dataset_param: dict[str, Any]
    collate_param: dict[str, Any]
    shuffle: bool = True
    drop_last: bool = False
    pin_memory: bool = False
    num_workers: int | None = None
    """``dataloader_param.num_workers`` (MindSpeed MM's FSDP trainer reads it there; its Megatron one takes the
    launch flag); ``MMDataModule(num_workers=...)`` wins."""
    strict: bool = False
    allow_outside_data_root: bool = False
    base_dir: Path = field(default_factory=Path.cwd)
    source: str = "data config"
    prefix: str = ""
    """``"data."`` for the ``data:`` section of a launch YAML (error messages name keys with it)."""
    group_by: str | None = None
    """``"data"`` (one frames x height x width per batch) or ``"frame"`` (one frame count per batch):
    ``sampler_type: LengthGroupedSampler`` with ``group_data`` / ``group_frame``
    (:mod:`lightning_mm.datamodules.grouped_sampler`); ``None``: Lightning's distributed sampler."""

    @property
    def loader_section(self) -> str:
        """The loader settings' place, for messages: ``the `dataloader_param` of <source>``."""
        return f"the `dataloader_param` of {self.source}"


def read_data_file(path: str | os.PathLike) -> MindSpeedDataConfig | None:
    """The MindSpeed MM data config in ``path``, or ``None`` when the file is this project's own data config (the
    format is told by :func:`lightning_mm.mindspeed.load.data_section`)."""
    from lightning_mm.mindspeed.load import data_section

    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"data config not found: {path}")
    found = data_section(load_mapping(path, error=DataConfigError))
    if found is None:
        return None
    section, prefix = found
    return parse_section(dict(section), source=str(path), prefix=prefix, base_dir=Path.cwd())


def _fail(source: str, key: str, message: str) -> Exception:
    return KeyReader(source, error=DataConfigError).fail(key, message)


def _bool(data: Mapping, key: str, default: bool, prefix: str, source: str) -> bool:
    return KeyReader(source, prefix, DataConfigError).flag(data.get(key, default), key, default)


def parse_section(
    section: dict[str, Any], source: str, prefix: str = "", base_dir: Path | None = None
) -> MindSpeedDataConfig:
    """Check the section's top level and its ``dataloader_param``."""
    section = check_keys(section, _SECTION_KEYS, prefix, source)
    if "dataset_param" not in section:
        raise _fail(source, prefix + "dataset_param", "missing (MindSpeed MM requires it)")
    raw_dataset = section["dataset_param"]
    dataset_type = raw_dataset.get("dataset_type") if isinstance(raw_dataset, Mapping) else None
    if dataset_type not in ("huggingface", "multimodal", "feature"):
        raise _fail(
            source,
            prefix + "dataset_param.dataset_type",
            f"{short_repr(dataset_type)} is not supported here (supported: huggingface, multimodal, feature)",
        )
    # The huggingface type's keys are checked here; the multimodal type (InternVL) checks its own dataset_param
    # and collate_param keys (lightning_mm.mindspeed.multimodal_data).
    multimodal = dataset_type in ("multimodal", "feature")  # feature: Wan latents (mindspeed.feature_data)
    dataset_param = (
        dict(raw_dataset) if multimodal else check_keys(raw_dataset, _DATASET_KEYS, prefix + "dataset_param.", source)
    )
    lp = prefix + "dataloader_param."
    raw_loader = section.get("dataloader_param")
    if isinstance(raw_loader, Mapping):
        for key in raw_loader:
            if key in _LAUNCH_FLAGS:
                raise _fail(
                    source,
                    lp + key,
                    f"MindSpeed MM takes it from the launch flags, not from here; set it as {_LAUNCH_FLAGS[key]}",
                )
            if key in _UNSUPPORTED_LOADER:
                raise _fail(source, lp + key, "a MindSpeed MM dataloader option this data module does not support")
    loader = check_keys(raw_loader, _LOADER_KEYS, lp, source)
    mode = loader.get("dataloader_mode", "sampler")
    if mode != "sampler":
        raise _fail(
            source,
            lp + "dataloader_mode",
            f"{short_repr(mode)} is not supported: Lightning installs a "
            "distributed sampler over the data-parallel ranks (mode 'sampler')",
        )
    sampler = loader.get("sampler_type", "BaseRandomBatchSampler")
    if sampler not in _SAMPLERS or (sampler == "LengthGroupedSampler" and dataset_type != "feature"):
        raise _fail(
            source,
            lp + "sampler_type",
            f"{short_repr(sampler)} is not supported (supported: "
            f"{', '.join(_SAMPLERS[:2])}: each rank gets distinct samples, "
            "shuffled or in order per `shuffle`; LengthGroupedSampler with "
            "dataset_type: feature)",
        )
    group_by = _group_by(loader, sampler, dataset_type, lp, source)
    if multimodal:
        collate = loader.get("collate_param") or {}
        if not isinstance(collate, Mapping):
            raise _fail(source, lp + "collate_param", f"must be a mapping, got {short_repr(collate)}")
        collate = dict(collate)
    else:
        collate = check_keys(loader.get("collate_param"), _COLLATE_KEYS, lp + "collate_param.", source)
        _bool(collate, "ignore_pad_token_for_loss", True, lp + "collate_param.", source)
        multiple = collate.get("pad_to_multiple_of")
        if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
            raise _fail(
                source,
                lp + "collate_param.pad_to_multiple_of",
                f"expected a positive integer, got {short_repr(multiple)}",
            )
    workers = loader.get("num_workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise _fail(source, lp + "num_workers", f"expected an integer >= 0, got {short_repr(workers)}")
    if _bool(loader, "enable_preload", False, lp, source):
        rank_zero_info(
            f"{source}: `{lp}enable_preload` has no effect here: Lightning moves each batch to the device itself"
        )
    if section.get("val_dataset_param") is not None:
        raise _fail(
            source,
            prefix + "val_dataset_param",
            "not supported here; give the validation records as dataset_param.basic_parameters.val_dataset",
        )
    return MindSpeedDataConfig(
        dataset_type=dataset_type,
        dataset_param=dataset_param,
        collate_param=collate,
        shuffle=_bool(loader, "shuffle", False, lp, source),  # MindSpeed MM's samplers default to shuffle=False
        drop_last=_bool(loader, "drop_last", False, lp, source),
        pin_memory=_bool(loader, "pin_memory", False, lp, source),
        num_workers=workers,
        strict=_bool(section, "strict", False, prefix, source),
        allow_outside_data_root=_bool(section, "allow_outside_data_root", False, prefix, source),
        base_dir=(base_dir or Path.cwd()).resolve(),
        source=source,
        prefix=prefix,
        group_by=group_by,
    )


def _group_by(loader: Mapping, sampler: str, dataset_type: str, lp: str, source: str) -> str | None:
    """MindSpeed MM's ``LengthGroupedSampler`` keys: which samples may share a batch."""
    frame, resolution, data = (
        _bool(loader, k, False, lp, source) for k in ("group_frame", "group_resolution", "group_data")
    )
    step = loader.get("initial_global_step_for_sampler", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _fail(source, lp + "initial_global_step_for_sampler", f"expected an integer >= 0, got {short_repr(step)}")
    if step:
        raise _fail(
            source,
            lp + "initial_global_step_for_sampler",
            "skipping steps at the start is not supported; "
            "resume from a checkpoint (it restores the "
            "loader's position) or set 0",
        )
    if resolution:
        raise _fail(
            source, lp + "group_resolution", "not supported (MindSpeed MM does not implement it either: use group_data)"
        )
    if frame and data:
        raise _fail(source, lp + "group_data", "cannot be true with group_frame (as in MindSpeed MM)")
    if not (frame or data):
        return None
    key = "group_data" if data else "group_frame"
    if sampler != "LengthGroupedSampler":
        raise _fail(
            source,
            lp + key,
            f"groups batches with sampler_type: LengthGroupedSampler only, not "
            f"{short_repr(sampler)} (MindSpeed MM ignores it there; set it false)",
        )
    if dataset_type != "feature":
        raise _fail(source, lp + key, f"supported with dataset_type: feature only, not {short_repr(dataset_type)}")
    return "data" if data else "frame"


def build_datasets(
    config: MindSpeedDataConfig,
) -> tuple[dict[str, Any], Callable[[list[dict]], dict], dict[str, DataReport]]:
    """``(splits, collate_fn, reports)`` for the config's ``dataset_type``: one dispatch for every type."""
    if config.dataset_type == "multimodal":
        if config.allow_outside_data_root:
            raise _fail(
                config.source, config.prefix + "allow_outside_data_root", "not supported with dataset_type: multimodal"
            )
        from lightning_mm.mindspeed.multimodal_data import build_multimodal_datasets

        splits, collate, reports = build_multimodal_datasets(
            config.dataset_param, config.collate_param, config.base_dir, config.source, config.strict
        )
        for report in reports.values():  # the huggingface builder reports its own; this one leaves it to us
            strict_or_warn(report, config.strict, config.source)
        return splits, collate, reports
    if config.dataset_type == "feature":
        from lightning_mm.mindspeed.feature_data import build_feature_datasets

        return build_feature_datasets(
            config.dataset_param,
            config.collate_param,
            config.base_dir,
            config.source,
            config.strict,
            prefix=config.prefix,
        )
    from lightning_mm.mindspeed.hf_data import build_huggingface_datasets

    return build_huggingface_datasets(
        config.dataset_param,
        config.collate_param,
        config.base_dir,
        config.source,
        config.strict,
        allow_outside_data_root=config.allow_outside_data_root,
        prefix=config.prefix,
    )
