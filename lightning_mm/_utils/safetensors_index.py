"""The safetensors format's names: its dtype names as torch dtypes, and the ``weight_map`` of a Hugging Face index.

One table and one index parser for every reader (the header check and sliced loading of ``init_from_hf_path``,
``hf_to_dcp``), so that a file one of them accepts the others accept too. Imports nothing from ``lightning_mm``
but the leaf :mod:`lightning_mm._utils.model_files`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from lightning_mm._utils.model_files import is_plain_file_name
from lightning_mm.errors import ConfigError

__all__ = ["DTYPES", "itemsize", "read_weight_map", "shard_files"]


def _dtypes() -> dict[str, torch.dtype]:
    # The names safetensors' own torch loader maps (safetensors.torch._TYPES), as far as this torch has them.
    names = {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "C64": "complex64",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }
    return {
        name: getattr(torch, attr)
        for name, attr in names.items()
        if isinstance(getattr(torch, attr, None), torch.dtype)
    }


DTYPES: Mapping[str, torch.dtype] = _dtypes()
"""safetensors dtype name (a header's ``"dtype"``) -> torch dtype."""


def itemsize(name: str) -> int | None:
    """Bytes per element of the safetensors dtype ``name``; ``None`` for a name not in :data:`DTYPES`."""
    dtype = DTYPES.get(name)
    return None if dtype is None else dtype.itemsize


def read_weight_map(index_file: Path, error: type[Exception] = ConfigError) -> dict[str, str]:
    """The ``weight_map`` of a Hugging Face index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``):
    tensor name -> the file that holds it.

    Anything else is ``error`` naming ``index_file``: a file that is not JSON, no ``weight_map`` mapping, or a file
    name that is not a plain name of a file next to the index (not a string, an absolute path, ``..``, a
    separator: an index never refers to files outside its directory).
    """
    try:
        weight_map = json.loads(Path(index_file).read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise error(f"{index_file}: not a safetensors index with a 'weight_map' ({err})") from None
    if not isinstance(weight_map, dict):
        raise error(f"{index_file}: not a safetensors index with a 'weight_map' (it is a {type(weight_map).__name__})")
    for name in weight_map.values():
        if not is_plain_file_name(name):
            raise error(
                f"{index_file}: 'weight_map' names {name!r}, which is not a file of the checkpoint directory "
                "(an index never refers to files outside its directory)"
            )
    return weight_map


def shard_files(weight_map: Mapping[str, str]) -> list[str]:
    """The files of ``weight_map``, each once, in the order the index first names them."""
    return list(dict.fromkeys(weight_map.values()))
