"""MindSpeed MM's Wan 2.1 and VACE feature-extraction launches read: their ``data.json`` and ``model.json``
(``ae``, ``text_encoder``) become an :class:`ExtractionPlan` (a VACE data config, ``dataset_type: vace``, a
:class:`~lightning_mm.mindspeed.vace_extraction.VaceExtractionPlan`, read there) that ``lightning-mm
extract-features`` runs,
and ``migrate``'s answer to a ``get_wan_feature.py`` / ``get_vace_feature.py`` launch names that command
(upstream: ``mindspeed_mm/tools/feature_extraction/``). Lightning-free."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_mm.errors import ConfigError

__all__ = ["ENTRY_SCRIPT", "ENTRY_SCRIPTS", "ExtractionPlan", "command_for_launch", "plan_extraction", "training_hint"]

ENTRY_SCRIPT = "get_wan_feature.py"
"""MindSpeed MM's Wan feature-extraction entry script, the launch this command stands for."""

ENTRY_SCRIPTS = (ENTRY_SCRIPT, "get_vace_feature.py")
"""The feature-extraction entry scripts this command stands for: Wan 2.1's and Wan VACE's."""


def command_for_launch(flags: Mapping[str, str | None]) -> str:
    """What ``migrate`` says of a ``get_wan_feature.py`` or ``get_vace_feature.py`` launch with these flags: the
    command line to run instead."""
    data, model = flags.get("--mm-data") or "DATA_JSON", flags.get("--mm-model") or "MODEL_JSON"
    return (
        f"run `lightning-mm extract-features --data {data} --model {model} --output OUT` from the launch directory "
        "instead (one process)"
    )


class ExtractionPlan:
    """What one run reads and writes, all checked before any work."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.videos: list[Path] = []
        self.captions: list[str] = []
        self.names: list[str] = []
        self.source_paths: list[str] = []
        """Each record's ``path`` in the written ``data.jsonl``: MindSpeed MM's ``DataFileReader`` joins the
        ``data.txt`` folder to it in combine mode (``os.path.join``), and ``_write_data_info`` keeps it."""
        self.num_frames = self.frame_interval = self.height = self.width = 0
        self.max_length = 0
        self.clean_text = False
        self.vae = self.text_encoder = self.tokenizer = Path()
        self.task = "t2v"
        self.image_encoder: Path | None = None


def _fail(source: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: `{key}`: {message}")


def read_json_config(path: Path, what: str) -> Mapping[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{what} {path}: not a readable JSON file ({err})") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} {path}: must hold a JSON object")
    return value


def _positive(pre: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = pre.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(source, f"dataset_param.preprocess_parameters.{key}", f"expected an integer >= 1, got {value!r}")
    return value


def annotation_records(path: Path) -> list[tuple[int, Any]]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            return list(enumerate(json.loads(text), start=1))
        except ValueError as err:
            raise ConfigError(f"{path}: not a JSON list ({err})") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except ValueError as err:
            raise ConfigError(f"{path}:{number}: not JSON ({err})") from None
    return out


def combine_lines(path: Path) -> list[tuple[Path, Path, str | None]]:
    """The ``(annotation file, video folder, folder as written)`` of each ``folder,annotation.json`` line of
    MindSpeed MM's ``data_storage_mode: combine`` ``data.txt`` (relative paths from the working directory, as
    MindSpeed MM's)."""
    out: list[tuple[Path, Path, str | None]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.strip().split(",")
        if len(parts) != 2:
            raise ConfigError(f"{path}:{number}: expected `video folder,annotation file`, got {line.strip()!r}")
        folder, annotation = Path(parts[0]).resolve(), Path(parts[1]).resolve()
        if not folder.is_dir():
            raise ConfigError(f"{path}:{number}: '{folder}' is not a directory")
        if not annotation.is_file():
            raise ConfigError(f"{path}:{number}: '{annotation}' does not exist")
        out.append((annotation, folder, parts[0]))
    return out


_AE_APPLIED = {"model_id": "wan_video_vae", "from_pretrained": None, "norm_latents": True, "do_sample": False}
_AE_NOTED = ("dtype", "enable_tiling", "tiling_param", "norm_mode")


def _check_i2v(processor: Any, source: str) -> str | None:
    """``ae.i2v_processor``: ``wan_i2v_processor`` with its ``image_encoder`` directory (``None`` when not given)."""
    if not isinstance(processor, Mapping):
        raise _fail(source, "ae.i2v_processor", "expected an object (processor_id, image_encoder)")
    for key, value in processor.items():
        if key == "processor_id" and value != "wan_i2v_processor":
            raise _fail(source, "ae.i2v_processor.processor_id", f"{value!r}: only 'wan_i2v_processor' is done here")
        elif key == "i2v_vae_encode_tiling":
            print(f"note: {source}: `ae.i2v_processor.{key}` is not applied (the VAE runs untiled)")
        elif key not in ("processor_id", "image_encoder"):
            raise _fail(source, f"ae.i2v_processor.{key}", "not applied by extract-features")
    encoder = processor.get("image_encoder")
    return encoder if isinstance(encoder, str) else None


def component_paths(
    model_config: Mapping[str, Any], tokenizer_config: Any, vae: Any, text_encoder: Any, tokenizer: Any
) -> tuple[Path, Path, Path]:
    """The VAE, text encoder and tokenizer directories of an extraction: each the command-line flag's value when
    given, else the ``from_pretrained`` of the model config's ``ae`` / ``text_encoder`` or of the data config's
    ``tokenizer_config``; neither is an error naming both."""
    sections = (
        ("--vae", vae, model_config.get("ae"), "ae.from_pretrained"),
        ("--text-encoder", text_encoder, model_config.get("text_encoder"), "text_encoder.from_pretrained"),
        ("--tokenizer", tokenizer, tokenizer_config, "dataset_param.tokenizer_config.from_pretrained"),
    )
    paths = []
    for flag, given, section, key in sections:
        value = given if given is not None else (section if isinstance(section, Mapping) else {}).get("from_pretrained")
        if not isinstance(value, str):
            raise ConfigError(f"{flag}: not given and no `{key}` in the configs")
        paths.append(Path(value))
    return paths[0], paths[1], paths[2]


def check_ae_keys(ae: Any, source: str) -> None:
    """MindSpeed MM's ``ae`` keys: the ones that change the latents must be as done here (the mode of the latent
    distribution, normalised with the VAE config's mean and std); tiling and the dtype are noted as not applied."""
    if not isinstance(ae, Mapping):
        return
    for key, value in ae.items():
        if key in _AE_APPLIED:
            wanted = _AE_APPLIED[key]
            if wanted is not None and value != wanted:
                raise _fail(source, f"ae.{key}", f"{value!r}: only {wanted!r} is done here")
        elif key == "i2v_processor":
            continue  # read with `task: i2v`
        elif key in _AE_NOTED:
            print(f"note: {source}: `ae.{key}` is not applied (the VAE runs untiled, in its saved dtype)")
        else:
            raise _fail(source, f"ae.{key}", "not applied by extract-features (t2v only)")


def plan_extraction(
    data: Path,
    model: Path | None,
    output: Path,
    vae: str | None = None,
    text_encoder: str | None = None,
    tokenizer: str | None = None,
    image_encoder: str | None = None,
) -> ExtractionPlan:
    """Read and check the configs, the records and the outputs; raises naming the key, line or file."""
    from lightning_mm.diffusers.wan_features import check_outputs, feature_file_name

    plan = ExtractionPlan()
    source = str(data)
    config = read_json_config(data, "--data")
    param = config.get("dataset_param")
    if not isinstance(param, Mapping):
        raise _fail(source, "dataset_param", "missing")
    model_config = read_json_config(model, "--model") if model is not None else {}
    plan.task = model_config.get("task", "t2v")
    if plan.task not in ("t2v", "i2v"):
        raise ConfigError(f"{model}: `task: {plan.task}`: only t2v and i2v (Wan 2.1) features are extracted here")
    if plan.task == "i2v":
        ae = model_config.get("ae") or {}
        processor = ae.get("i2v_processor") if isinstance(ae, Mapping) else None
        configured = _check_i2v(processor, str(model)) if processor is not None else None
        encoder = image_encoder if image_encoder is not None else configured
        if encoder is None:
            raise ConfigError("--image-encoder: not given and no `ae.i2v_processor.image_encoder` in the configs")
        plan.image_encoder = Path(encoder)
    basic = param.get("basic_parameters")
    if not isinstance(basic, Mapping) or not isinstance(basic.get("data_path"), str):
        raise _fail(source, "dataset_param.basic_parameters.data_path", "missing: the records (video `path`, `cap`)")
    data_path = Path(basic["data_path"]).resolve()
    if not data_path.is_file():
        raise _fail(source, "dataset_param.basic_parameters.data_path", f"'{data_path}' does not exist")
    mode = basic.get("data_storage_mode", "combine" if data_path.suffix == ".txt" else None)
    if mode == "combine":  # MindSpeed MM's data.txt: `folder,annotation.json` lines
        sources = combine_lines(data_path)
    elif mode is None:
        folder = Path(basic.get("data_folder") or data_path.parent).resolve()
        if not folder.is_dir():
            raise _fail(source, "dataset_param.basic_parameters.data_folder", f"'{folder}' is not a directory")
        sources = [(data_path, folder, None)]
    else:
        raise _fail(source, "dataset_param.basic_parameters.data_storage_mode", f"{mode!r}: only 'combine' is read")
    pre = param.get("preprocess_parameters")
    if not isinstance(pre, Mapping):
        raise _fail(source, "dataset_param.preprocess_parameters", "missing: num_frames, max_height, max_width")
    plan.num_frames = _positive(pre, "num_frames", source)
    plan.frame_interval = _positive(pre, "frame_interval", source, 1)
    plan.height = _positive(pre, "max_height", source)
    plan.width = _positive(pre, "max_width", source)
    others = sorted(k for k in pre if k not in ("num_frames", "frame_interval", "max_height", "max_width"))
    if others:
        print(
            f"note: {source}: `dataset_param.preprocess_parameters` {others} are not applied (frames from the start, "
            "short-side resized and centre-cropped, as the raw-video training path)"
        )
    tok = param.get("tokenizer_config") or {}
    if not isinstance(tok, Mapping):
        raise _fail(source, "dataset_param.tokenizer_config", "expected an object")
    plan.max_length = tok.get("model_max_length", 512)
    if isinstance(plan.max_length, bool) or not isinstance(plan.max_length, int) or plan.max_length < 1:
        raise _fail(source, "dataset_param.tokenizer_config.model_max_length", f"got {plan.max_length!r}")
    plan.clean_text = bool(param.get("enable_text_preprocessing", False))
    methods = param.get("text_preprocess_methods")
    if plan.clean_text and methods is not None:
        names = [
            m.get("method") if isinstance(m, Mapping) else m
            for m in (methods if isinstance(methods, list) else [methods])
        ]
        if names != ["whitespace_clean"]:
            raise _fail(source, "dataset_param.text_preprocess_methods", f"{names}: only whitespace_clean is done here")
    plan.vae, plan.text_encoder, plan.tokenizer = component_paths(model_config, tok, vae, text_encoder, tokenizer)
    seen: dict[str, str] = {}
    for annotation, folder, written, number, record in (
        (a, f, w, n, r) for a, f, w in sources for n, r in annotation_records(a)
    ):
        where = f"{annotation}:{number}"
        if not isinstance(record, dict) or not isinstance(record.get("path"), str) or not record["path"]:
            raise ConfigError(f"{where}: a record needs the video `path`")
        caption = record.get("cap")
        if isinstance(caption, list) and len(caption) == 1:
            caption = caption[0]
        if not isinstance(caption, str):
            raise ConfigError(f"{where}: `cap` must be one caption (a string), got {caption!r}")
        video = (folder / record["path"]).resolve()
        if not video.is_relative_to(folder):
            raise ConfigError(f"{where}: `path` {record['path']!r} resolves outside {folder}")
        if not video.is_file():
            raise ConfigError(f"{where}: video {record['path']!r} does not exist in {folder}")
        name = feature_file_name(record["path"])
        if name in seen:
            raise ConfigError(f"{where}: its feature file {name} is also that of {seen[name]} (same video name)")
        seen[name] = where
        plan.records.append(record)
        plan.videos.append(video)
        plan.captions.append(caption)
        plan.names.append(name)
        plan.source_paths.append(record["path"] if written is None else os.path.join(written, record["path"]))
    if not plan.records:
        raise ConfigError(f"{data_path}: no records")
    check_ae_keys(model_config.get("ae"), str(model))
    check_outputs(output, ["data.jsonl", *(f"features/{n}" for n in plan.names)])
    return plan


def training_hint(jsonl: Path) -> str:
    """How a data config trains on the features listed in ``jsonl`` (printed after the extraction)."""
    return (
        "train on them with a data config of `dataset_type: feature`, `basic_parameters.data_path: "
        f"{jsonl}`, `data_folder: {jsonl.parent}`"
    )
