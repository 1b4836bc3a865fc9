"""Deciding what to load from a Hugging Face checkpoint: which file and key fills each model tensor.

Only safetensors headers are read here (names, shapes, dtypes), never tensor data, so the whole check runs on a
meta-device model before any memory is spent. Checkpoint keys are renamed the way Hugging Face's own loader
renames them (``transformers``' conversion mapping: e.g. a LLaVA checkpoint's ``language_model.model.*`` keys
become ``model.language_model.*``). The result is strict: a model parameter no checkpoint key fills, a checkpoint
key no model tensor takes, or a shape that differs is an error that lists the names.
:mod:`lightning_mm.hf.loading` does the reading.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from lightning_mm._compat import keys_to_ignore_on_load_unexpected
from lightning_mm._utils import safetensors_index as _safetensors
from lightning_mm._utils.model_files import model_file
from lightning_mm._utils.modules import names_by_tensor, transformers_class
from lightning_mm._utils.suggestions import listing
from lightning_mm.checkpoint.checkpoint_errors import CheckpointError, CheckpointIntegrityError, CheckpointMismatchError

__all__ = [
    "CheckpointError",
    "TensorInfo",
    "SafetensorsIndex",
    "LoadEntry",
    "LoadPlan",
    "checkpoint_key_renamer",
    "build_load_plan",
]

log = logging.getLogger(__name__)

_SHOWN = 20


def _listing(names: list[str]) -> str:
    return listing(names, _SHOWN)


def strict_load_problems(missing: list[str], unexpected: list[str], misshapen: list[str]) -> list[str]:
    """The lines of a strict-loading error: weights missing from the checkpoint, checkpoint weights the model does
    not have, and weights of another shape (empty when the checkpoint fits)."""
    problems = []
    if missing:
        problems.append(f"{len(missing)} model weight(s) missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint weight(s) the model does not have: {_listing(unexpected)}")
    if misshapen:
        problems.append(f"{len(misshapen)} weight(s) with a different shape: {_listing(misshapen)}")
    return problems


@dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives and what it is."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name, e.g. "F32", "BF16"
    start: int = 0
    """Byte offset of the tensor's data in the file."""


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one ``.safetensors`` file, from its header alone (8-byte length, JSON, then the data).

    Offsets and sizes are checked against the file, so a truncated or inconsistent file fails here.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise CheckpointIntegrityError(f"{path}: too short to be a safetensors file")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise CheckpointIntegrityError(f"{path}: header length {length} exceeds the file size {size}")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointIntegrityError(f"{path}: the safetensors header is not valid JSON ({err})") from None
    data_start = 8 + length
    tensors = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointIntegrityError(f"{path}: malformed header entry for '{key}'") from None
        numel = 1
        for d in shape:
            numel *= d
        size_of = _safetensors.itemsize(dtype)
        expected = numel * size_of if size_of is not None else end - begin
        if not (0 <= begin <= end and data_start + end <= size and end - begin == expected):
            raise CheckpointIntegrityError(
                f"{path}: tensor '{key}' has data offsets {[begin, end]} that do not fit its "
                f"{dtype} shape {list(shape)} or the file size"
            )
        tensors[key] = TensorInfo(path.name, key, shape, dtype, data_start + begin)
    return tensors


@dataclass(frozen=True)
class SafetensorsIndex:
    """The tensors of a Hugging Face directory's safetensors files, read from their headers."""

    directory: str
    tensors: dict[str, TensorInfo]

    @classmethod
    def from_directory(
        cls, directory: str | Path, weights_name: str = "model.safetensors", layout: str = "safetensors weights"
    ) -> SafetensorsIndex:
        """Read ``<weights_name>.index.json`` (sharded) or ``weights_name`` (one file) in ``directory``, checking
        that every tensor the index lists is in the file it names; ``layout`` names what is read, in errors."""
        root = Path(directory)
        if not root.is_dir():
            raise CheckpointIntegrityError(f"init_from_hf_path: '{root}' is not a directory")
        index_file = root / f"{weights_name}.index.json"
        if index_file.is_file() or index_file.is_symlink():
            model_file(root, index_file.name, CheckpointIntegrityError)
            weight_map = _safetensors.read_weight_map(index_file, CheckpointIntegrityError)
            files = sorted(_safetensors.shard_files(weight_map))
        elif (root / weights_name).is_file() or (root / weights_name).is_symlink():
            weight_map, files = None, [weights_name]
        else:
            others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
            raise CheckpointIntegrityError(
                f"{root}: no {weights_name} or {index_file.name}"
                + (f" (found {', '.join(others)}; only {layout} are read)" if others else "")
            )
        tensors: dict[str, TensorInfo] = {}
        for name in files:
            path = root / name
            if not path.is_file() and not path.is_symlink():
                raise CheckpointIntegrityError(f"{index_file}: lists '{name}', which does not exist in {root}")
            model_file(
                root, name, CheckpointIntegrityError
            )  # a link only into the directory, or a hub snapshot's blobs
            for key, info in read_safetensors_header(path).items():
                if key in tensors:
                    raise CheckpointIntegrityError(f"{root}: tensor '{key}' is in both {tensors[key].file} and {name}")
                tensors[key] = info
        if weight_map is not None:
            listed_elsewhere = sorted(k for k, f in weight_map.items() if k not in tensors or tensors[k].file != f)
            if listed_elsewhere:
                raise CheckpointIntegrityError(
                    f"{index_file}: the index and the files disagree on {len(listed_elsewhere)} tensor(s): "
                    f"{_listing(listed_elsewhere)}"
                )
        return cls(str(root), tensors)


@dataclass(frozen=True)
class LoadEntry:
    """One model tensor (a parameter, with all its tied names, or a persistent buffer) and its source."""

    names: tuple[str, ...]
    """Every name of the tensor in the model's state dict (several when weights are tied); the first is used."""
    source: TensorInfo
    is_parameter: bool
    duplicates: tuple[TensorInfo, ...] = ()
    """Further checkpoint tensors for the same (tied) tensor: they must hold the same values."""
    transpose: tuple[int, int] | None = None
    """The checkpoint stores the tensor with these two dimensions swapped (Transformers' ``Transpose`` conversion,
    e.g. Qwen3-VL-MoE's fused experts); never the first dimension, so row slices stay row slices."""
    stacked: tuple[tuple[TensorInfo, ...], ...] | None = None
    """The checkpoint stores a 3-D experts tensor one 2-D piece per expert (Transformers' ``MergeModulelist``, then
    ``Concatenate(dim=1)`` when several pieces make one expert's rows): per expert, its pieces in row order, e.g.
    Qwen3-MoE's Hub layout ``experts.{e}.gate_proj.weight`` and ``experts.{e}.up_proj.weight`` for ``gate_up_proj``.
    A rank reads only the pieces of the experts (and rows) it holds. ``source`` is the first piece."""


@dataclass(frozen=True)
class LoadPlan:
    """What to read for every model tensor, after the strict checks."""

    directory: str
    entries: tuple[LoadEntry, ...]
    ignored_unexpected: tuple[str, ...] = ()
    """Checkpoint keys the model class declares ignorable (``_keys_to_ignore_on_load_unexpected``)."""
    buffers_kept: tuple[str, ...] = ()
    """Persistent buffers absent from the checkpoint: they keep the value computed at construction."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Checkpoint key -> model key, for the keys whose names differ."""

    @property
    def files(self) -> list[str]:
        return sorted(
            {e.source.file for e in self.entries}
            | {d.file for e in self.entries for d in e.duplicates}
            | {p.file for e in self.entries for pieces in (e.stacked or ()) for p in pieces}
        )


@contextmanager
def _as_class(model: nn.Module, cls: type | None) -> Iterator[None]:
    """View ``model`` as ``cls`` for a moment (its Transformers base: same layout, fewer methods)."""
    if cls is None or type(model) is cls:
        yield
        return
    original = model.__class__
    model.__class__ = cls
    try:
        yield
    finally:
        model.__class__ = original


def checkpoint_key_renamer(model: nn.Module) -> Callable[[str], tuple[str, str | None]]:
    """``rename(checkpoint_key) -> (model_key, converter_pattern)``, as Transformers renames keys on load.

    An adapter class lives outside ``transformers`` and would count as custom code, whose renamings Transformers
    skips; the model is briefly viewed as its Transformers base class so that it gets the same renamings.
    ``converter_pattern`` is not ``None`` when the key needs a tensor conversion (fusing, splitting), which
    sliced loading cannot do.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    with _as_class(model, transformers_class(type(model))):
        conversions = get_model_conversion_mapping(cast("PreTrainedModel", model))  # a Transformers model
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    model_keys = dict.fromkeys(model.state_dict(keep_vars=True), True)
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, str | None]:
        return rename_source_key(key, renamings, converters, prefix, model_keys)

    rename.converters = converters  # type: ignore[attr-defined]
    return rename


def _row_preserving_transpose(converters: list[Any], pattern: str) -> tuple[int, int, bool] | None:
    """``(dim0, dim1, check_dims)`` when the converter of ``pattern`` only swaps two non-leading dimensions of one
    tensor (a conversion that sliced loading can do); ``None`` otherwise."""
    from transformers.core_model_loading import Transpose

    for conv in converters:
        sources, targets = list(conv.source_patterns), list(conv.target_patterns)
        if pattern not in sources or len(sources) != 1 or len(targets) != 1:
            continue
        ops = list(conv.operations)
        if len(ops) == 1 and type(ops[0]) is Transpose and 0 not in (ops[0].dim0, ops[0].dim1):
            return ops[0].dim0, ops[0].dim1, bool(ops[0].check_dims)
    return None


def _stacking_sources(converters: list[Any], pattern: str) -> list[str] | None:
    """The source patterns, in row order, when the converter of ``pattern`` stacks one 2-D tensor per expert into a
    3-D tensor (``MergeModulelist(dim=0)``), concatenating several sources' pieces along the rows
    (``Concatenate(dim=1)``): a conversion that sliced loading can do piece by piece. ``None`` otherwise."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    for conv in converters:
        sources, targets = list(conv.source_patterns), list(conv.target_patterns)
        if pattern not in sources or len(targets) != 1 or any(s.count("*") != 1 for s in sources):
            continue
        ops = list(conv.operations)
        merge = len(ops) >= 1 and type(ops[0]) is MergeModulelist and ops[0].dim == 0
        if merge and len(sources) == 1 and len(ops) == 1:
            return sources
        if merge and len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim == 1:
            return sources
    return None


def _expert_of(key: str, pattern: str) -> int | None:
    """The expert index that the ``*`` of ``pattern`` matches in checkpoint key ``key``."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(rf"(?:^|\.){regex}$", key)
    return int(found.group(1)) if found else None


def _stack_pieces(
    name: str,
    shape: tuple[int, ...],
    sources: list[str],
    pieces: dict[tuple[int, int], TensorInfo],
) -> tuple[tuple[tuple[TensorInfo, ...], ...] | None, list[str], list[str]]:
    """Per expert, its pieces in row order; or the missing pieces and the misshapen ones."""
    missing: list[str] = []
    misshapen: list[str] = []
    if len(shape) != 3:
        return None, [], [f"{name}: model {list(shape)} is not a 3-D experts tensor, the checkpoint stores pieces"]
    experts, rows, cols = shape
    (s0, e0), any_piece = next(iter(pieces.items()))
    prefix = any_piece.key[: len(any_piece.key) - len(sources[s0].replace("*", str(e0)))]  # e.g. "model.layers.1."
    stacked = []
    for e in range(experts):
        found = [pieces.get((s, e)) for s in range(len(sources))]
        missing.extend(f"{prefix}{sources[s].replace('*', str(e))}" for s, f in enumerate(found) if f is None)
        present = [f for f in found if f is not None]
        if len(present) == len(found):
            flat = all(len(f.shape) == 2 and f.shape[1] == cols for f in present)
            if not flat or sum(f.shape[0] for f in present) != rows:
                misshapen.append(
                    f"{name}, expert {e}: checkpoint pieces {[list(f.shape) for f in present]}, model {list(shape)}"
                )
            stacked.append(tuple(present))
    beyond = sorted(f"{p.key}" for (_, e), p in pieces.items() if e >= experts)
    if beyond:
        misshapen.append(f"{name}: the checkpoint has more than the model's {experts} experts ({_listing(beyond)})")
    if missing or misshapen:
        return None, missing, misshapen
    return tuple(stacked), [], []


def _model_tensors(model: nn.Module) -> tuple[list[tuple[list[str], bool]], dict[str, tuple[int, ...]]]:
    """Distinct state-dict tensors as ``([names...], is_parameter)`` and every name's shape."""
    params = {id(p) for p in model.parameters()}
    state = model.state_dict(keep_vars=True)
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    return [(names, key in params) for key, names in names_by_tensor(state.items()).items()], shapes


def build_load_plan(model: nn.Module, index: SafetensorsIndex) -> LoadPlan:
    """Match every checkpoint tensor of ``index`` to ``model``'s tensors; any mismatch is one error listing all."""
    rename = checkpoint_key_renamer(model)
    groups, shapes = _model_tensors(model)
    owner = {name: i for i, (names, _) in enumerate(groups) for name in names}
    ignore_unexpected = [re.compile(p) for p in keys_to_ignore_on_load_unexpected(model)]

    sources: dict[int, list[TensorInfo]] = {}
    unexpected, ignored, needs_conversion, misshapen = [], [], [], []
    renamed: dict[str, str] = {}
    reported: set[int] = set()  # tensors already named in an error (misshapen): not "missing" as well
    transposed: dict[int, tuple[int, int]] = {}
    pieces: dict[int, tuple[str, list[str], dict[tuple[int, int], TensorInfo]]] = {}
    for key, info in sorted(index.tensors.items()):
        target, converter = rename(key)
        swap = None
        stacking = None
        if converter is not None and target in owner:
            stacking = _stacking_sources(getattr(rename, "converters", []), converter)
        if stacking is not None:
            expert = _expert_of(key, converter)  # type: ignore[arg-type]
            if expert is not None:
                renamed[key] = target
                _, _, parts = pieces.setdefault(owner[target], (target, stacking, {}))
                parts[(stacking.index(converter), expert)] = info  # type: ignore[arg-type]
                continue
        if converter is not None:
            transpose = _row_preserving_transpose(getattr(rename, "converters", []), converter)
            if transpose is None or target not in owner:
                needs_conversion.append(f"{key} (pattern {converter!r})")
                continue
            d0, d1, check_dims = transpose
            swapped = list(info.shape)
            swapped[d0], swapped[d1] = swapped[d1], swapped[d0]
            if not (check_dims and info.shape == shapes[target]) and tuple(swapped) == shapes[target]:
                swap = (d0, d1)
        if swap is not None:
            renamed[key] = target
            sources.setdefault(owner[target], []).append(info)
            transposed[owner[target]] = swap
            continue
        if target != key:
            renamed[key] = target
        if target not in owner:
            if any(p.search(key) or p.search(target) for p in ignore_unexpected):
                ignored.append(key)
            else:
                unexpected.append(key if target == key else f"{key} (as {target})")
            continue
        if info.shape != shapes[target]:
            misshapen.append(f"{key}: checkpoint {list(info.shape)}, model {list(shapes[target])}")
            reported.add(owner[target])
            continue
        sources.setdefault(owner[target], []).append(info)

    missing: list[str] = []
    buffers_kept: list[str] = []
    entries: list[LoadEntry] = []
    stacked: dict[int, tuple[tuple[TensorInfo, ...], ...]] = {}
    for i, (target, stacking, parts) in pieces.items():
        if i in sources:  # also stored whole: two sources for one tensor
            unexpected.extend(sorted(p.key for p in parts.values()))
            continue
        layout, absent, wrong = _stack_pieces(target, shapes[target], stacking, parts)
        missing.extend(absent)
        misshapen.extend(wrong)
        if layout is None:
            reported.add(i)
            continue
        stacked[i] = layout
        sources[i] = [layout[0][0]]
    for i, (names, is_parameter) in enumerate(groups):
        found = sources.get(i)
        if not found and i in reported:
            continue
        if not found:
            (missing if is_parameter else buffers_kept).extend(names[:1])
            continue
        entries.append(
            LoadEntry(tuple(names), found[0], is_parameter, tuple(found[1:]), transposed.get(i), stacked.get(i))
        )

    problems = strict_load_problems(missing, unexpected, misshapen)
    if needs_conversion:
        problems.append(
            f"{len(needs_conversion)} weight(s) need a tensor conversion that sliced loading cannot do: "
            f"{_listing(needs_conversion)}"
        )
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {index.directory} does not fit {type(model).__name__} (strict loading):\n  - "
            + "\n  - ".join(problems)
        )
    if ignored:
        log.info("%s: ignoring checkpoint keys the model declares ignorable: %s", index.directory, _listing(ignored))
    if buffers_kept:
        log.info(
            "%s: buffers not in the checkpoint keep their constructed values: %s",
            index.directory,
            _listing(buffers_kept),
        )
    return LoadPlan(index.directory, tuple(entries), tuple(ignored), tuple(buffers_kept), renamed)
