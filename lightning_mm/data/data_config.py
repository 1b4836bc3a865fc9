"""The data config (``data.json`` or YAML): the counterpart of MindSpeed MM's ``build_mm_dataset`` settings.

Example::

    data_root: data            # relative to this file; record files and image paths are relative to data_root
    train: train.jsonl         # a file or a list of files (JSON list or JSON lines)
    val: val.jsonl
    test: null
    preprocess:
      tokenizer: tokenizer     # a local Hugging Face tokenizer directory (relative to this file)
      processor: null          # optional local Hugging Face image processor directory
      image_size: 32
      max_length: 32
      truncation: true
    loader: {batch_size: 8, num_workers: 0, shuffle: true, drop_last: false, padding: longest}
    strict: false              # true: any bad record is an error; false: skipped, counted and reported
    allow_outside_data_root: false  # true: record files and images may lie outside data_root (absolute paths,
                                    # '..', symlinks leading out); false: such a record is a bad record

Every key is checked: an unknown key or a path that does not exist fails before training, naming the key. The
file is read by the project's bounded safe loader (:mod:`lightning_mm._utils.yaml_io`): duplicate keys, a top level that
is not a mapping, non-UTF-8 bytes and alias bombs are errors naming the file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_mm._utils.suggestions import find_unknown_key
from lightning_mm._utils.yaml_io import load_mapping, short_repr
from lightning_mm.errors import ConfigError, MissingFileError

__all__ = ["DataConfig", "PreprocessConfig", "LoaderConfig", "DataConfigError", "check_mapping_keys"]


class DataConfigError(ConfigError):
    """A data config that cannot be used as written."""


@dataclass(frozen=True)
class PreprocessConfig:
    tokenizer: Path | None = None
    processor: Path | None = None
    image_size: int = 224
    max_length: int = 512
    truncation: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_key: str = "images"


@dataclass(frozen=True)
class LoaderConfig:
    batch_size: int = 1
    num_workers: int = 0
    shuffle: bool = True
    drop_last: bool = False
    pin_memory: bool = False
    padding: str = "longest"
    seed: int = 0


@dataclass(frozen=True)
class DataConfig:
    """A validated data config; paths are absolute."""

    data_root: Path
    splits: dict[str, tuple[Path, ...]]
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    strict: bool = False
    source: str | None = None
    allow_outside_data_root: bool = False

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> DataConfig:
        """Read ``data.json`` or a YAML file (safe loader) and validate it."""
        path = Path(path)
        if not path.is_file():
            raise MissingFileError(f"data config not found: {path}")
        data = load_mapping(path, error=DataConfigError)
        return cls.from_dict(data, base_dir=path.parent, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, base_dir: str | os.PathLike = ".", source: str | None = None) -> DataConfig:
        where = source or "data config"
        base = Path(base_dir).resolve()

        def fail(key: str, message: str) -> DataConfigError:
            return DataConfigError(f"{where}: `{key}`: {message}")

        check_mapping_keys(data, _TOP_KEYS, "", where)
        outside = data.get("allow_outside_data_root", False)
        if not isinstance(outside, bool):
            raise fail("allow_outside_data_root", f"expected true or false, got {short_repr(outside)}")
        root = (base / str(data.get("data_root", "."))).resolve()
        if not root.is_dir():
            raise fail("data_root", f"directory not found: {root}")
        splits: dict[str, tuple[Path, ...]] = {}
        for split in ("train", "val", "test"):
            value = data.get(split)
            if value is None:
                continue
            files = [value] if isinstance(value, str) else value
            if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
                raise fail(split, f"expected a file name or a list of file names, got {short_repr(value)}")
            resolved = []
            for name in files:
                file = (root / name).resolve()
                if not outside and not file.is_relative_to(root):
                    raise fail(
                        split,
                        f"{short_repr(name)} lies outside data_root {root} "
                        "(set `allow_outside_data_root: true` to allow it)",
                    )
                if not file.is_file():
                    raise fail(split, f"file not found: {file}")
                resolved.append(file)
            splits[split] = tuple(resolved)
        if "train" not in splits and not splits:
            raise fail("train", "no split is given (train, val or test)")

        pre = _section(data, "preprocess", where)
        check_mapping_keys(pre, [f.name for f in fields(PreprocessConfig)], "preprocess.", where)
        for key in ("tokenizer", "processor"):
            if pre.get(key) is not None:
                directory = base / str(pre[key])
                if not directory.exists():
                    raise fail(f"preprocess.{key}", f"not found: {directory}")
                pre[key] = directory
        for key in ("image_mean", "image_std"):
            if key in pre:
                if not isinstance(pre[key], (list, tuple)) or len(pre[key]) != 3:
                    raise fail(f"preprocess.{key}", f"expected three numbers, got {short_repr(pre[key])}")
                try:
                    pre[key] = tuple(float(x) for x in pre[key])
                except (TypeError, ValueError):
                    raise fail(f"preprocess.{key}", f"expected three numbers, got {short_repr(pre[key])}") from None
                _check_normalisation(key, pre[key], fail)
        _check_positive_ints(pre, ("image_size", "max_length"), "preprocess.", fail)
        _check_bools(pre, ("truncation",), "preprocess.", fail)
        if pre.get("tokenizer") is None:
            raise fail("preprocess.tokenizer", "a local tokenizer directory is required")

        loader = _section(data, "loader", where)
        check_mapping_keys(loader, [f.name for f in fields(LoaderConfig)], "loader.", where)
        _check_positive_ints(loader, ("batch_size",), "loader.", fail)
        if "num_workers" in loader and (not isinstance(loader["num_workers"], int) or loader["num_workers"] < 0):
            raise fail(
                "loader.num_workers", f"expected a non-negative integer, got {short_repr(loader['num_workers'])}"
            )
        _check_bools(loader, ("shuffle", "drop_last", "pin_memory"), "loader.", fail)
        if loader.get("padding", "longest") not in ("longest", "max_length"):
            raise fail("loader.padding", f"expected 'longest' or 'max_length', got {short_repr(loader['padding'])}")
        strict = data.get("strict", False)
        if not isinstance(strict, bool):
            raise fail("strict", f"expected true or false, got {short_repr(strict)}")
        return cls(root, splits, PreprocessConfig(**pre), LoaderConfig(**loader), strict, source, outside)


_TOP_KEYS = ("data_root", "train", "val", "test", "preprocess", "loader", "strict", "allow_outside_data_root")


def _section(data: dict, key: str, where: str) -> dict:
    """A nested section as a dict: absent or empty (``null``) is ``{}``; anything else must be a mapping."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataConfigError(f"{where}: `{key}` must be a mapping, got {short_repr(value)}")
    return dict(value)


def check_mapping_keys(data: Any, known: Any, prefix: str, where: str) -> dict[str, Any]:
    """``data`` as a dict; a non-mapping, or a key not in ``known`` (with the nearest suggested), is a
    :class:`DataConfigError` naming ``where`` and the key (``prefix`` is the section's dotted path)."""
    if not isinstance(data, Mapping):
        raise DataConfigError(f"{where}: `{prefix.rstrip('.') or '<top>'}` must be a mapping, got {short_repr(data)}")
    unknown = find_unknown_key(data, list(known), prefix)
    if unknown is not None:
        shown, hint = unknown
        raise DataConfigError(f"{where}: unknown key `{shown}`{hint}")
    return dict(data)


def _check_positive_ints(data: dict, keys: tuple[str, ...], prefix: str, fail: Any) -> None:
    for key in keys:
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] <= 0):
            raise fail(prefix + key, f"expected a positive integer, got {short_repr(data[key])}")


def _check_normalisation(key: str, values: tuple[float, ...], fail: Any) -> None:
    """Pixels become ``(x - mean) / std``: a non-finite mean or std, or a zero std, makes every sample NaN or inf."""
    if not all(math.isfinite(v) for v in values):
        raise fail(f"preprocess.{key}", f"expected finite numbers, got {list(values)}")
    if key == "image_std" and any(v == 0 for v in values):
        raise fail(f"preprocess.{key}", f"a standard deviation of 0 divides every pixel by zero, got {list(values)}")


def _check_bools(data: dict, keys: tuple[str, ...], prefix: str, fail: Any) -> None:
    for key in keys:
        if key in data and not isinstance(data[key], bool):
            raise fail(prefix + key, f"expected true or false, got {short_repr(data[key])}")
