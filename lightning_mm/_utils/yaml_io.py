"""One safe loader for every config file the project reads (the FSDP2 YAML, the data config, YAML or JSON).

Free of Lightning and torch so any layer can use it. On top of PyYAML's safe loader it bounds what a small file
may turn into and keeps its errors short:

* the file must be a regular file of at most :data:`MAX_BYTES` and valid UTF-8 (an error names the line);
* at most :data:`MAX_ALIASES` aliases, :data:`MAX_DEPTH` levels of nesting and :data:`MAX_NODES` values once
  every alias is expanded (so a 300-byte "billion laughs" file is an error, not a hang); anchors and aliases
  in an ordinary config still work;
* a key written twice in one mapping is an error naming the key and its line (merge keys ``<<`` may still be
  overridden, as YAML intends);
* every message names the file, has a line where one is known, and quotes values through :func:`short_repr`.

:func:`load_mapping` also checks the shape: an empty file (or one with only comments) is an empty mapping,
anything else that is not a mapping (``[]``, ``0``, ``false``, ``null``) is an error.
"""

from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lightning_mm.errors import ConfigError, MissingFileError

__all__ = [
    "ConfigFileError",
    "load_config",
    "load_mapping",
    "short_repr",
    "MAX_BYTES",
    "MAX_ALIASES",
    "MAX_DEPTH",
    "MAX_NODES",
]

MAX_BYTES = 1 << 20
"""Largest config file read (1 MiB)."""
MAX_ALIASES = 100
"""Most aliases (``*name``) in one file."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and sequences."""
MAX_NODES = 100_000
"""Most values (scalars, sequences, mappings) a file may expand to once its aliases are resolved."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3
_REPR.maxlong = 40


def short_repr(value: Any) -> str:
    """A bounded ``repr`` for error messages: long strings, lists and deep structures are cut with ``...``."""
    return _REPR.repr(value)


class ConfigFileError(ConfigError):
    """A config file that cannot be read as written (callers may ask for their own subclass instead)."""


_EMPTY = object()  # what an empty YAML document (nothing, or only comments) loads as, before load_config maps it


class _Limit(Exception):
    def __init__(self, message: str, mark: Any = None) -> None:
        super().__init__(message)
        self.message, self.mark = message, mark


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with counted aliases, bounded depth and expansion, and no duplicate keys."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0
        self.last_node: Any = None

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _Limit(f"more than {MAX_ALIASES} aliases", self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Limit(f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return _EMPTY
        _check_expansion(node)
        return self.construct_document(node)

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        self.last_node = node  # the innermost value being built, for the line of a ValueError
        return super().construct_object(node, deep=deep)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise _Limit(f"duplicate key {short_repr(key)} (first on line {seen[key]})", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _check_expansion(root: yaml.Node) -> None:
    """Count the values ``root`` expands to (aliases count each time they are used); refuse cycles and bombs."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise _Limit("an alias refers to a value that contains it (recursive anchor)", node.start_mark)
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_NODES:
                raise _Limit(
                    f"expands to more than {MAX_NODES} values (aliases counted each time they are used)",
                    node.start_mark,
                )
        active.discard(key)
        sizes[key] = total
        return total

    size(root)


def _read_text(path: Path, error: type[Exception]) -> str:
    if not path.is_file():
        raise MissingFileError(f"config file not found: {path}")
    with open(path, "rb") as handle:
        raw = handle.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise error(f"{path}: larger than {MAX_BYTES // 1024} KiB; a config file is expected to be small")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x})") from None


def _where(path: Path, mark: Any) -> str:
    return f"{path}:{mark.line + 1}" if mark is not None else str(path)


def _load_yaml(path: Path, text: str, error: type[Exception]) -> Any:
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except _Limit as err:
        raise error(f"{_where(path, err.mark)}: {err.message}") from None
    except yaml.MarkedYAMLError as err:
        problem = " ".join(str(p) for p in (err.context, err.problem) if p)[:200]
        raise error(f"{_where(path, err.problem_mark)}: not valid YAML: {problem}") from None
    except yaml.YAMLError as err:
        raise error(f"{path}: not valid YAML: {str(err)[:200]}") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply") from None
    except ValueError as err:  # e.g. an integer longer than Python's digit limit
        mark = loader.last_node.start_mark if loader.last_node is not None else None
        raise error(f"{_where(path, mark)}: cannot read a value: {str(err)[:200]}") from None
    finally:
        loader.dispose()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Limit(f"duplicate key {short_repr(key)}")
        out[key] = value
    return out


def _load_json(path: Path, text: str, error: type[Exception]) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Limit as err:
        raise error(f"{path}: {err.message}") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply") from None
    except ValueError as err:  # e.g. an integer longer than Python's digit limit
        raise error(f"{path}: not valid JSON: {str(err)[:200]}") from None


def load_config(path: str | os.PathLike, error: type[Exception] = ConfigFileError, empty: Any = None) -> Any:
    """Read a YAML file (or JSON, for a ``.json`` suffix) within the limits above; failures raise ``error``.

    A YAML file with no document (empty, or only comments) gives ``empty``.
    """
    path = Path(path)
    text = _read_text(path, error)
    if path.suffix.lower() == ".json":
        return _load_json(path, text, error)
    data = _load_yaml(path, text, error)
    return empty if data is _EMPTY else data


def load_mapping(path: str | os.PathLike, error: type[Exception] = ConfigFileError) -> dict[str, Any]:
    """:func:`load_config`, and the top level must be a mapping: an empty file (or only comments) gives ``{}``;
    anything else, an explicit ``null`` included, is an error naming the file."""
    data = load_config(path, error, empty={})
    if not isinstance(data, Mapping):
        raise error(
            f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__} {short_repr(data)}"
        )
    return dict(data)
