"""Checkpoint conversion in one process, without a GPU: DCP <-> Hugging Face directory.

(DCP -> one torch file is :func:`lightning_mm.checkpoint.consolidate.dcp_to_torch`.)

Only what a conversion needs is read: ``dcp_to_hf`` reads the model weights (never the optimiser state) one
safetensors shard at a time; ``hf_to_dcp`` streams tensors from the HF files into DCP one at a time.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from lightning_mm._utils.model_files import model_file
from lightning_mm._utils.safetensors_index import DTYPES, read_weight_map, shard_files
from lightning_mm.checkpoint import atomic
from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError
from lightning_mm.checkpoint.checkpoint_layout import (
    EXTRA_KEY,
    FORMAT_VERSION,
    KIND_WEIGHTS,
    MARKER,
    META_FILE,
    SEP,
    model_key,
)
from lightning_mm.checkpoint.consolidate import check_output, writing
from lightning_mm.checkpoint.manifest import (
    MANIFEST_FILE,
    RecordingFileSystem,
    file_entries,
    write_manifest,
)
from lightning_mm.checkpoint.safe import check_weights_only, load_weights_only
from lightning_mm.checkpoint.source import open_source, single_process_quiet
from lightning_mm.checkpoint.writer import write_file
from lightning_mm.errors import ConfigError, MissingFileError
from lightning_mm.hf.checkpoint_records import choose_record
from lightning_mm.hf.hf_file_layout import HFLayout, hf_layout

__all__ = ["dcp_to_hf", "hf_to_dcp", "parse_size", "read_config_json", "side_files", "ConvertError"]

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


class ConvertError(ConfigError):
    """Bad input to a converter (a size, a config file, a directory); the message names it."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"1.5GiB"``, ``"1024"`` -> bytes: a positive, finite number of bytes, else an error
    (``inf``, ``nan``, ``0``, ``-1``, ``5XB`` and ``1e400GB`` are refused)."""
    match = _SIZE.match(str(text))
    if match is None:
        raise ConvertError(
            f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB, 2GiB or 1048576 "
            f"(units {', '.join(_UNITS)})"
        )
    number = float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]
    if not math.isfinite(number) or number < 1:
        raise ConvertError(f"--max-shard-size {text!r}: must be a finite size of at least 1 byte")
    return int(number)


def read_config_json(path: Path) -> dict[str, Any]:
    """A ``config.json``: a JSON object whose ``model_type`` is a string and ``architectures`` a list of strings;
    anything else is a one-line error naming the file."""
    if not path.is_file():
        raise ConvertError(f"{path}: no config.json there")
    config = _json_mapping(path)
    if "model_type" in config and not isinstance(config["model_type"], str):
        raise ConvertError(f"{path}: `model_type` must be a string, got {config['model_type']!r}")
    architectures = config.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures)
    ):
        raise ConvertError(f"{path}: `architectures` must be a list of class names, got {architectures!r}")
    return config


def _json_mapping(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConvertError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ConvertError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
    except (RecursionError, ValueError) as err:
        raise ConvertError(f"{path}: not valid JSON: {str(err)[:200] or type(err).__name__}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


# The files of a pretrained directory that a converted one needs besides its weights and config.json: tokenizer,
# processor, chat template and generation config (AutoTokenizer / AutoProcessor / generate read them).
_SIDE_FILE = re.compile(
    r"^(tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|"
    r"merges\.txt|spiece\.model|sentencepiece\.bpe\.model|.*\.tiktoken|(.+_)?preprocessor_config\.json|"
    r"processor_config\.json|chat_template\.(json|jinja)|generation_config\.json)$"
)
_SIDE_DIRS = ("additional_chat_templates",)


def side_files(pretrained: Path) -> list[Path]:
    """The tokenizer, processor, chat template and generation config files of a pretrained directory (no
    weights, no config.json), relative to it."""
    found = [Path(f.name) for f in sorted(pretrained.iterdir()) if f.is_file() and _SIDE_FILE.match(f.name)]
    for name in _SIDE_DIRS:
        folder = pretrained / name
        if folder.is_dir():
            found += [Path(name) / f.name for f in sorted(folder.iterdir()) if f.is_file()]
    return found


def _copy_side_files(pretrained: Path, directory: Path) -> None:
    for relative in side_files(pretrained):
        (directory / relative).parent.mkdir(exist_ok=True)
        shutil.copyfile(pretrained / relative, directory / relative)  # a new file: the umask's mode


def _pretrained_source(
    record: dict[str, Any], hf_config: dict[str, Any], explicit: str | Path | None, notes: list[str] | None
) -> Path | None:
    """Where the side files come from: ``explicit`` (must be a directory), else the pretrained directory the
    checkpoint records, when it still exists."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_dir():
            raise ConvertError(f"--pretrained-dir {explicit}: not a directory")
        return path
    recorded = record.get("pretrained") or hf_config.get("_name_or_path") or None
    if recorded and Path(recorded).is_absolute() and Path(recorded).is_dir():
        return Path(recorded)
    if notes is not None:
        notes.append(
            f"the checkpoint's pretrained directory {recorded} no longer exists"
            if recorded
            else "the checkpoint records no pretrained directory"
        )
        notes[-1] += (
            "; no tokenizer, processor or chat template files were copied (give --pretrained-dir for "
            "AutoTokenizer / AutoProcessor to load the output)"
        )
    return None


# --------------------------------------------------------------------------------------------- to HF
def _hf_config(
    source_meta: dict[str, Any], source: str, prefix: str | None, config: str | Path | None
) -> tuple[str, dict[str, Any], dict[str, Any], str]:
    """The prefix, HF config, record and the name of the config's origin (for messages)."""
    if config is not None:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise MissingFileError(f"--config: no config.json at {config}")
        return (prefix if prefix is not None else "model."), read_config_json(path), {}, str(path)
    record = choose_record((source_meta.get(EXTRA_KEY) or {}).get("hf") or [], prefix, source)
    return record["prefix"], json.loads(record["config"]), record, source


def _file_keys(stored: dict[str, str], layout: HFLayout, src: str | Path) -> dict[str, str]:
    """File key -> stored checkpoint key, for every tensor ``save_pretrained`` writes (tied weights once)."""
    out: dict[str, str] = {}
    missing = []
    for file_key, names in layout.keys.items():
        found = next((stored[n] for n in names if n in stored), None)
        if found is None:
            missing.append(names[0])
        else:
            out[file_key] = found
    covered = {n for names in layout.keys.values() for n in names}
    _check_keys_match(src, layout, missing, sorted(n for n in stored if n not in covered))
    return out


def _check_keys_match(src: str | Path, layout: HFLayout, missing: list[str], unexpected: list[str]) -> None:
    """The checkpoint's model keys and the model's must be the same: any ``missing`` or ``unexpected`` is an error."""
    if missing or unexpected:
        raise ConvertError(
            f"{src}: the checkpoint's model keys do not match {layout.config.architectures[0]}'s: "
            f"{len(missing)} missing {missing[:20]}, {len(unexpected)} not in the model {unexpected[:20]}"
        )


def dcp_to_hf(
    src: str | Path,
    out_dir: str | Path,
    prefix: str | None = None,
    dtype: str | None = None,
    max_shard_size: int = 5 * 10**9,
    config: str | Path | None = None,
    pretrained_dir: str | Path | None = None,
    notes: list[str] | None = None,
    force: bool = False,
) -> Path:
    """Write the Hugging Face model of a checkpoint as ``save_pretrained`` would write it (``force``: replace an
    earlier output directory, one with a ``config.json``, once the new one is complete).

    The model keys of the checkpoint under ``prefix`` (the recorded one by default: ``model.`` for an
    MMLightningModule) are written under the key names of the saved layout (Transformers' save-time renaming),
    tied weights once, with ``config.json``, ``generation_config.json`` for a generative model, and safetensors
    shards (see :mod:`.hf_export`). ``dtype`` (fp32, bf16, fp16) casts floating tensors. Tensors are streamed
    shard by shard, except for a model whose ``save_pretrained`` converts tensors (e.g. Qwen3-MoE's fused experts,
    saved one per expert): its tensors are read whole and converted by Transformers' own save-time steps.

    The tokenizer, processor, chat template and generation config files (:func:`side_files`) are copied from
    ``pretrained_dir``, or else from the pretrained directory the checkpoint records (``init_from_hf_path``) when
    it still exists; ``notes`` receives a line when neither is there. A failed write (e.g. a full disk) leaves no
    partial directory and raises :class:`~lightning_mm.checkpoint.checkpoint_errors.CheckpointWriteError` naming the
    output.
    """

    out = Path(out_dir)
    if not isinstance(max_shard_size, int) or isinstance(max_shard_size, bool) or max_shard_size < 1:
        raise ConvertError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    check_output(out, force, kind="hf")
    cast = None
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ConvertError(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        cast = _DTYPES[dtype]
    source = open_source(src)
    prefix, hf_config, record, origin = _hf_config(source.meta, str(src), prefix, config)
    pretrained = _pretrained_source(record, hf_config, pretrained_dir, notes)
    start = model_key(prefix)
    stored = {k[len(start) :]: k for k in source.shapes if k.startswith(start)}
    if not stored:
        available = sorted({k.split(SEP, 1)[1].split(".", 1)[0] for k in source.shapes if k.startswith("state_dict")})
        raise ConvertError(f"{src}: no model key starts with {prefix!r} (top-level modules: {available})")
    layout = hf_layout(hf_config, origin)
    if layout.converted:
        return _write_converted(source, stored, layout, src, out, cast, max_shard_size, pretrained)
    names = {key: file_key for file_key, key in _file_keys(stored, layout, src).items()}

    shards: list[list[str]] = [[]]
    size = 0
    for key in names:
        dt = cast if cast is not None and source.dtypes[key].is_floating_point else source.dtypes[key]
        nbytes = torch.Size(source.shapes[key]).numel() * dt.itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    floating = [source.dtypes[k] for k in names if source.dtypes[k].is_floating_point]
    config_dtype = cast if cast is not None else (floating[0] if floating else None)

    def read(keys: list[str]) -> dict[str, torch.Tensor]:  # one shard at a time, under its file keys
        tensors = source.read_full(keys)
        return {names[k]: (t.to(cast) if cast is not None and t.is_floating_point() else t) for k, t in tensors.items()}

    partial = atomic.partial_path(out)
    with writing(partial, out):
        partial.mkdir()
        layout.save_side_files(partial, config_dtype)
        # safetensors creates its files owner-only (0600); they get the mode of any new file here (the umask's).
        mode = (partial / "config.json").stat().st_mode & 0o777
        _write_shards(partial, (read(keys) for keys in shards), len(shards), mode)
        if pretrained is not None:
            _copy_side_files(pretrained, partial)
        atomic.fsync_dir(partial)
    atomic.commit(partial, out)
    return out


def _write_shards(directory: Path, shards: Iterable[dict[str, torch.Tensor]], count: int, mode: int) -> None:
    """Safetensors files as ``save_pretrained`` names them (and the index when there are several), with ``mode``."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        save_file({k: t.contiguous() for k, t in shard.items()}, str(directory / file), metadata={"format": "pt"})
        (directory / file).chmod(mode)
        for key, tensor in shard.items():
            weight_map[key] = file
            total += tensor.numel() * tensor.element_size()
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_converted(
    source: Any,
    stored: dict[str, str],
    layout: HFLayout,
    src: str | Path,
    out: Path,
    cast: torch.dtype | None,
    max_shard_size: int,
    pretrained: Path | None,
) -> Path:
    """``dcp_to_hf`` for a model whose ``save_pretrained`` converts tensors (e.g. Qwen3-MoE's fused experts are
    saved one tensor per expert): the model's tensors are read whole, converted by Transformers' own save-time
    steps, then written. Needs the model's size in memory, unlike the streaming path."""
    expected = layout.in_memory_names()
    known = set(expected)
    unexpected = sorted(n for n in stored if n not in known)
    _check_keys_match(src, layout, [n for n in expected if n not in stored], unexpected)
    full = source.read_full([stored[n] for n in expected])
    state = {}
    for name in expected:
        tensor = full.pop(stored[name])
        state[name] = tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor
    saved = layout.revert(state)
    del state
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in saved.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    floating = [t.dtype for t in saved.values() if t.is_floating_point()]
    partial = atomic.partial_path(out)
    with writing(partial, out):
        partial.mkdir()
        layout.save_side_files(partial, floating[0] if floating else None)
        mode = (partial / "config.json").stat().st_mode & 0o777  # as the streaming path: not safetensors' 0600
        _write_shards(partial, shards, len(shards), mode)
        if pretrained is not None:
            _copy_side_files(pretrained, partial)
        atomic.fsync_dir(partial)
    atomic.commit(partial, out)
    return out


# ------------------------------------------------------------------------------------------ from HF
def _safetensors_header(file: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """Name, dtype and shape of each tensor of a safetensors file; a damaged file is an error naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return [(name, (p := f.get_slice(name)).get_dtype(), tuple(p.get_shape())) for name in f.keys()]  # noqa: SIM118 - safe_open has no __iter__
    except Exception as error:  # safetensors raises its own SafetensorError
        if isinstance(error, OSError) and not file.is_file():
            raise
        raise CheckpointIntegrityError(f"{file}: not a readable safetensors file ({error})") from None


class _HFTensors:
    """The tensors of a Hugging Face directory, read one at a time (safetensors, or a weights-only .bin)."""

    def __init__(self, hf_dir: Path) -> None:
        self.dir = hf_dir
        self.files = self._weight_files()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._where: dict[str, Path] = {}
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}
        for file in self.files:
            if file.suffix == ".safetensors":
                for name, dtype, shape in _safetensors_header(file):
                    if dtype not in DTYPES:
                        raise ConvertError(f"{file}: tensor {name} has unsupported dtype {dtype}")
                    self._add(name, file, shape, DTYPES[dtype])
            else:
                tensors = load_weights_only(file, mmap=True)
                if not isinstance(tensors, dict):
                    raise ConvertError(f"{file}: expected a dict of tensors, found {type(tensors).__name__}")
                self._bins[file] = tensors
                for name, t in tensors.items():
                    self._add(name, file, tuple(t.shape), t.dtype)

    def _add(self, name: str, file: Path, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if name in self._where:
            raise ConvertError(f"{self.dir}: tensor {name} is in both {self._where[name].name} and {file.name}")
        self._where[name], self.shapes[name], self.dtypes[name] = file, shape, dtype

    def _weight_files(self) -> list[Path]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.dir / index_name
            if index.is_file() or index.is_symlink():
                model_file(self.dir, index_name, CheckpointIntegrityError)
                weight_map = read_weight_map(index, CheckpointIntegrityError)
                files = [self.dir / f for f in shard_files(weight_map)]
                missing = [str(f) for f in files if not f.is_file() and not f.is_symlink()]
                if missing:
                    raise MissingFileError(f"{index} names missing files: {missing}")
                return [model_file(self.dir, f.name, CheckpointIntegrityError) for f in files]
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (self.dir / name).is_file() or (self.dir / name).is_symlink():
                return [model_file(self.dir, name, CheckpointIntegrityError)]
        raise MissingFileError(
            f"{self.dir}: no Hugging Face weights (model.safetensors, its index, or pytorch_model.bin)"
        )

    def get(self, name: str) -> torch.Tensor:
        file = self._where[name]
        if file in self._bins:
            return self._bins[file][name]
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name)


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans from meta tensors and reads each tensor only when the writer asks for it."""

    def __init__(self, read: Any) -> None:
        super().__init__(flatten_state_dict=False)
        self._read = read

    def resolve_data(self, write_item: Any) -> Any:
        return self._read(write_item.index.fqn)


def _checkpoint_renamer(config: dict[str, Any]) -> Any:
    """Transformers' load-time key renaming for the model the config describes (``None`` if no class is known).

    Some families (LLaVA, InternVL, Qwen2.5-VL) store keys in an older layout that Transformers renames on load;
    the renamed keys are the module's, and so the ones a resume checks against.
    """
    from lightning_mm.hf.derived_adapters import resolve_model_class
    from lightning_mm.hf.model_hub import ModelHubError

    try:
        _, model_cls, _ = resolve_model_class(None, config)
    except ModelHubError:
        return None
    from transformers import AutoConfig

    from lightning_mm.hf.pretrained_index import checkpoint_key_renamer

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    with torch.device("meta"):
        model = model_cls(hf_config)
    return checkpoint_key_renamer(model)


def hf_to_dcp(hf_dir: str | Path, dst: str | Path, prefix: str = "model.", force: bool = False) -> Path:
    """A Hugging Face model directory as a weights checkpoint that ``MMFSDP2Strategy`` loads.

    Keys become ``<prefix><module key>`` (``model.`` is where an MMLightningModule keeps the model), with the
    renaming Transformers applies on load for the families ModelHub knows. ``fit`` starts from
    it with a fresh optimiser and loop; validate/test/predict use it directly; any world size loads it.
    """
    import lightning

    hf_dir, dst = Path(hf_dir), Path(dst)
    check_output(dst, force, kind="dcp")
    config_file = hf_dir / "config.json"
    if not config_file.is_file() and not config_file.is_symlink():
        raise MissingFileError(f"{hf_dir}: no config.json (is this a Hugging Face model directory?)")
    model_file(hf_dir, "config.json", CheckpointIntegrityError)
    config = read_config_json(config_file)
    hf = _HFTensors(hf_dir)
    rename = _checkpoint_renamer(config) if config.get("model_type") else None
    keys = {}
    for name in hf.shapes:
        target, converter = rename(name) if rename is not None else (name, None)
        if converter is not None:
            raise ConvertError(
                f"{hf_dir}: weight {name} needs a tensor conversion ({converter}) on load, which "
                "hf-to-dcp does not do; load this model with TransformersModel(init_from_hf_path=...)"
            )
        keys[model_key(prefix + target)] = name
    planned = {k: torch.empty(hf.shapes[n], dtype=hf.dtypes[n], device="meta") for k, n in keys.items()}
    architectures = config.get("architectures") or []
    meta = {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": {prefix + name: {MARKER: key} for key, name in keys.items()},
        EXTRA_KEY: {
            "format_version": FORMAT_VERSION,
            "format": "torch_dcp",
            "kind": KIND_WEIGHTS,
            "world_size": 1,
            "manifest": MANIFEST_FILE,
            "ranks": [],
            "source": str(hf_dir),
            "hf": [
                {
                    "prefix": prefix,
                    "architecture": architectures[0] if architectures else None,
                    "config": json.dumps(config),
                    "pretrained": str(hf_dir.resolve()),
                }
            ],
        },
    }
    check_weights_only(meta)
    partial = atomic.partial_path(dst)

    def read(key: str) -> torch.Tensor:
        return hf.get(keys[key]).contiguous()

    writer = FileSystemWriter(partial, thread_count=1, sync_files=True)
    writer.fs = files = RecordingFileSystem()
    with writing(partial, dst):
        with single_process_quiet():
            dcp.save(planned, storage_writer=writer, planner=_StreamingSavePlanner(read), no_dist=True)
        write_file(meta, partial / META_FILE)
        write_manifest(partial, [file_entries(files.written)], [".metadata", META_FILE])
        atomic.fsync_dir(partial)
    atomic.commit(partial, dst)
    return dst
