"""MindSpeed MM's Wan VACE feature-extraction configs read (``examples/vace/feature_extract/data.json`` with
``dataset_type: vace``, ``model.json``; upstream ``mindspeed_mm/tools/feature_extraction/get_vace_feature.py``):
everything ``lightning-mm extract-features`` needs, checked before any work. Lightning-free."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mm.errors import ConfigError

__all__ = ["VACE_KEYS", "VaceRecord", "VaceExtractionPlan", "is_vace", "plan_vace_extraction", "plan_any_extraction"]

VACE_KEYS = ("video", "src_video", "src_video_mask", "src_ref_images")
"""The path keys of a VACE record, joined to the ``data.txt`` folder (``DataFileReader``'s ``vace`` mode)."""

_PRE = "dataset_param.preprocess_parameters"
_NO_EFFECT = ("frame_interval", "auto_interval", "max_height", "max_width", "speed_factor", "cfg", "force_resolution")
"""``preprocess_parameters`` that MindSpeed MM's ``VACEVideoProcessor`` reads but never uses."""
_TYPES = {
    "video_processor_type": ("VACEVideoProcessor",),
    "video_reader_type": ("DecordVideo",),
    "image_reader_type": ("Image", "torchvision", "CLIPImageProcessor"),
    "image_processer_type": ("image2image",),
}
_LINEAR = ("bilinear", "bicubic")
_METHODS = ("basic_clean", "whitespace_clean")


@dataclass
class VaceRecord:
    """One record: the ``data.jsonl`` line (``record``), its files, caption, feature file name, the frames to read
    and the target size (``VACEVideoProcessor``), and the first clip's frame width (its crop)."""

    record: dict[str, Any]
    where: str
    video: Path
    src_video: Path | None
    mask: Path | None
    refs: list[Path]
    caption: str
    name: str
    ids: list[int] = field(default_factory=list)
    size: tuple[int, int] = (0, 0)
    width: int = 0


@dataclass
class VaceExtractionPlan:
    """What one VACE run reads and writes."""

    records: list[VaceRecord] = field(default_factory=list)
    pipeline: Any = None
    text_methods: list[str] = field(default_factory=list)
    max_length: int = 512
    vae: Path = Path()
    text_encoder: Path = Path()
    tokenizer: Path = Path()


def is_vace(config: Mapping[str, Any]) -> bool:
    """Whether a data config is MindSpeed MM's VACE one (``dataset_type`` or ``data_storage_mode`` ``vace``)."""
    param = config.get("dataset_param")
    if not isinstance(param, Mapping):
        return False
    basic = param.get("basic_parameters")
    mode = basic.get("data_storage_mode") if isinstance(basic, Mapping) else None
    return param.get("dataset_type") == "vace" or mode == "vace"


def _fail(source: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: `{key}`: {message}")


def _number(value: Any, source: str, key: str, integer: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        raise _fail(source, key, f"expected a {'n integer' if integer else ' number'} > 0, got {value!r}")
    return value


def _triple(value: Any, source: str, key: str) -> tuple[int, int, int]:
    if not isinstance(value, list) or len(value) != 3:
        raise _fail(source, key, f"expected three integers, got {value!r}")
    first, second, third = (int(_number(v, source, key, integer=True)) for v in value)
    return first, second, third


def _stats(param: Mapping[str, Any], source: str, key: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    out = []
    for name in ("mean", "std"):
        value = param.get(name)
        values: list[Any] = value if isinstance(value, list) else [value]
        if len(values) not in (1, 3) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise _fail(source, f"{key}.param.{name}", f"expected a number or three, got {value!r}")
        if name == "std" and any(v == 0 for v in values):
            raise _fail(source, f"{key}.param.std", "must not be 0")
        out.append(tuple(float(v) for v in values))
    return out[0], out[1]


def _resize(param: Mapping[str, Any], source: str, key: str, antialias: bool) -> tuple[str, bool, bool]:
    unknown = sorted(set(param) - {"size", "interpolation_mode", "antialias", "align_corners"})
    if unknown:
        raise _fail(source, f"{key}.param.{unknown[0]}", "not applied by extract-features")
    if param.get("size") != "auto":
        raise _fail(source, f"{key}.param.size", f"{param.get('size')!r}: only 'auto' (the processor's size) is done")
    mode = param.get("interpolation_mode", "bilinear")
    if mode not in _LINEAR:
        raise _fail(source, f"{key}.param.interpolation_mode", f"{mode!r}: one of {_LINEAR}")
    flags = [param.get("antialias", antialias), param.get("align_corners", False)]
    for name, value in zip(("antialias", "align_corners"), flags):
        if not isinstance(value, bool):
            raise _fail(source, f"{key}.param.{name}", f"expected true or false, got {value!r}")
    return mode, flags[0], flags[1]


def _pipeline(pre: Mapping[str, Any], source: str) -> Any:
    """The ``train_pipeline``: exactly MindSpeed MM's VACE recipe's steps, their parameters read."""
    from lightning_mm.diffusers.vace_features import VacePipeline

    pipe = VacePipeline()
    pipeline = pre.get("train_pipeline")
    if not isinstance(pipeline, Mapping):
        raise _fail(source, f"{_PRE}.train_pipeline", "missing: the video and image steps")
    shapes = {
        "video": ["ResizeCropVideo", "ToTensorVideo", "norm_fun"],
        "image": ["ToTensorVideo", "norm_fun", "ResizeToFill"],
    }
    for part, wanted in shapes.items():
        steps: list[Any] = pipeline.get(part) or []
        key = f"{_PRE}.train_pipeline.{part}"
        names = (
            [s.get("trans_type") if isinstance(s, Mapping) else s for s in steps] if isinstance(steps, list) else steps
        )
        if names != wanted or not isinstance(steps, list):
            raise _fail(source, key, f"{names}: only MindSpeed MM's VACE steps {wanted} are done here")
        for index, step in enumerate(steps):
            param = step.get("param") or {}
            where = f"{key}[{index}]"
            if step["trans_type"] == "norm_fun":
                mean, std = _stats(param, source, where)
                if part == "video":
                    pipe.video_mean, pipe.video_std = mean, std
                else:
                    pipe.image_mean, pipe.image_std = mean, std
            elif step["trans_type"] == "ResizeCropVideo":
                pipe.video_mode, pipe.video_antialias, pipe.video_align_corners = _resize(param, source, where, False)
            elif step["trans_type"] == "ResizeToFill":
                pipe.image_mode, pipe.image_antialias, pipe.image_align_corners = _resize(param, source, where, False)
            elif param:
                raise _fail(source, f"{where}.param", "ToTensorVideo takes no parameters")
    return pipe


def _text(param: Mapping[str, Any], source: str, plan: VaceExtractionPlan) -> Mapping[str, Any]:
    if param.get("use_text_processer", False) is not True:
        raise _fail(source, "dataset_param.use_text_processer", "must be true: the features hold the tokenized text")
    if param.get("enable_text_preprocessing", True):
        methods = param.get("text_preprocess_methods")
        if methods is None:
            raise _fail(source, "dataset_param.text_preprocess_methods", "missing (clean_caption is not done here)")
        for item in methods if isinstance(methods, list) else [methods]:
            name = item.get("method") if isinstance(item, Mapping) else item
            if name not in _METHODS or (isinstance(item, Mapping) and item.get("param")):
                raise _fail(source, "dataset_param.text_preprocess_methods", f"{item!r}: only {_METHODS} are done")
            plan.text_methods.append(name)
        if "basic_clean" in plan.text_methods:
            import importlib.util

            if importlib.util.find_spec("ftfy") is None:
                raise _fail(
                    source,
                    "dataset_param.text_preprocess_methods",
                    "basic_clean needs the ftfy package (pip install ftfy)",
                )
    tok = param.get("tokenizer_config") or {}
    if not isinstance(tok, Mapping):
        raise _fail(source, "dataset_param.tokenizer_config", "expected an object")
    plan.max_length = _number(
        tok.get("model_max_length", 512), source, "dataset_param.tokenizer_config.model_max_length", True
    )
    return tok


def _path_value(value: Any) -> Any:
    """``check_none``: ``null`` and NaN are no file."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _file(folder: Path, value: Any, where: str, key: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: `{key}`: expected a file path, got {value!r}")
    path = (folder / value).resolve()
    if not path.is_relative_to(folder):
        raise ConfigError(f"{where}: `{key}` {value!r} resolves outside {folder}")
    if not path.is_file():
        raise ConfigError(f"{where}: `{key}` {value!r} does not exist in {folder}")
    return path


def _record(record: Any, where: str, folder: Path, written: str) -> VaceRecord:
    """One annotation record checked; its ``data.jsonl`` copy with the paths joined (``_change_path``)."""
    if not isinstance(record, dict):
        raise ConfigError(
            f"{where}: a VACE record is an object (video, cap, src_video, src_video_mask, src_ref_images)"
        )
    for key in (*VACE_KEYS, "cap"):
        if key not in record:
            raise ConfigError(
                f"{where}: `{key}`: missing (MindSpeed MM's VACE records carry {VACE_KEYS} and cap; src_* may be null)"
            )
    caption = record["cap"]
    if not isinstance(caption, str):
        raise ConfigError(f"{where}: `cap` must be one caption (a string), got {caption!r}")
    values = {key: _path_value(record[key]) for key in VACE_KEYS}
    video = _file(folder, values["video"], where, "video")
    src = _file(folder, values["src_video"], where, "src_video") if values["src_video"] else None
    mask = _file(folder, values["src_video_mask"], where, "src_video_mask") if values["src_video_mask"] else None
    if mask is not None and src is None:
        raise ConfigError(f"{where}: `src_video_mask` without `src_video`: the mask marks the control video's pixels")
    refs_value = values["src_ref_images"]
    if refs_value and not isinstance(refs_value, list):
        raise ConfigError(f"{where}: `src_ref_images`: expected a list of image paths or null, got {refs_value!r}")
    refs = [_file(folder, v, where, "src_ref_images") for v in refs_value or []]
    written_record = dict(record)
    for key, value in values.items():
        if value is None:
            written_record[key] = None
        elif value:
            written_record[key] = (
                [os.path.join(written, v) for v in value] if isinstance(value, list) else os.path.join(written, value)
            )
    from lightning_mm.diffusers.vace_features import caption_file_name

    return VaceRecord(written_record, where, video, src, mask, refs, caption, caption_file_name(caption))


def _frames(entry: VaceRecord, pre: Mapping[str, Any], source: str) -> None:
    """``VACEVideoProcessor``'s frame ids and size for one record (its clips' headers read, not decoded); clips
    of different frame sizes in a record (control video and mask) and too-short clips are refused."""
    from lightning_mm.diffusers.vace_features import clip_timing, vace_target
    from lightning_mm.errors import DataError

    clips = [("src_video", entry.src_video), ("src_video_mask", entry.mask), ("video", entry.video)]
    timings = [(key, clip_timing(path)) for key, path in clips if path is not None]
    first_key, first = timings[0]
    for key, timing in timings[1:]:
        if key == "src_video_mask" and (timing.height, timing.width) != (first.height, first.width):
            raise DataError(
                f"{entry.where}: `src_video_mask` is {timing.width}x{timing.height}, its `src_video` "
                f"{first.width}x{first.height}: the mask must cover the control video pixel for pixel"
            )
    length = min(t.length for _, t in timings)
    downsample = tuple(a * b for a, b in zip(pre["vae_stride"], pre["vae_patch_size"]))
    try:
        entry.ids, entry.size = vace_target(
            first,
            length,
            pre["max_hxw"],
            pre["num_frames"],
            pre["train_fps"],
            downsample,
            pre["keep_last"],
        )
    except DataError as err:
        raise DataError(f"{entry.where}: `{first_key}`: {err}") from None
    entry.width = first.width


def _check_vae(vae: Path) -> None:
    """The VAE's factors must be the 4x in time and 8x in space that the mask latents assume."""
    config_file = vae / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_file}: not a readable config.json ({err})") from None
    temporal = 2 ** sum(bool(t) for t in config.get("temperal_downsample") or [])
    spatial = 2 ** (len(config.get("dim_mult") or []) - 1)
    if (temporal, spatial) != (4, 8):
        raise ConfigError(
            f"{config_file}: a {temporal}x temporal, {spatial}x spatial VAE; VACE's mask latents "
            "(get_vace_feature.py) need Wan's 4x and 8x"
        )


def plan_vace_extraction(
    config: Mapping[str, Any],
    source: str,
    model_config: Mapping[str, Any],
    model_source: str,
    output: Path,
    vae: str | None,
    text_encoder: str | None,
    tokenizer: str | None,
) -> VaceExtractionPlan:
    """Read and check a VACE data config, the model config and the records; raises naming the key, line or file."""
    from lightning_mm.diffusers.wan_features import check_outputs
    from lightning_mm.mindspeed.feature_launch import (
        annotation_records,
        check_ae_keys,
        combine_lines,
        component_paths,
    )

    plan = VaceExtractionPlan()
    param = config["dataset_param"]
    basic = param.get("basic_parameters")
    if not isinstance(basic, Mapping) or not isinstance(basic.get("data_path"), str):
        raise _fail(source, "dataset_param.basic_parameters.data_path", "missing: the data.txt (folder,annotation)")
    mode = basic.get("data_storage_mode")
    if mode != "vace":
        raise _fail(source, "dataset_param.basic_parameters.data_storage_mode", f"{mode!r}: VACE data is 'vace'")
    if basic.get("reserved_keys") is not None:
        raise _fail(source, "dataset_param.basic_parameters.reserved_keys", "not applied by extract-features")
    data_path = Path(basic["data_path"]).resolve()
    if not data_path.is_file():
        raise _fail(source, "dataset_param.basic_parameters.data_path", f"'{data_path}' does not exist")
    pre = param.get("preprocess_parameters")
    if not isinstance(pre, Mapping):
        raise _fail(source, _PRE, "missing")
    for key, allowed in _TYPES.items():
        if pre.get(key) not in allowed:
            raise _fail(source, f"{_PRE}.{key}", f"{pre.get(key)!r}: one of {allowed}")
    num_frames = _number(pre.get("num_frames"), source, f"{_PRE}.num_frames", True)
    if (num_frames - 1) % 4:
        raise _fail(source, f"{_PRE}.num_frames", f"{num_frames}: must be 4k + 1 (VACEVideoProcessor)")
    max_hxw = pre.get("max_hxw")
    if max_hxw not in (480 * 832, 720 * 1280):
        raise _fail(source, f"{_PRE}.max_hxw", f"{max_hxw!r}: VACEVideoProcessor takes 399360 or 921600")
    if pre.get("zero_start", True) is not True:
        raise _fail(source, f"{_PRE}.zero_start", "only true (clips from their start) is done here")
    keep_last = pre.get("keep_last", True)
    if not isinstance(keep_last, bool):
        raise _fail(source, f"{_PRE}.keep_last", f"expected true or false, got {keep_last!r}")
    frames = {
        "num_frames": num_frames,
        "max_hxw": max_hxw,
        "train_fps": _number(pre.get("train_fps"), source, f"{_PRE}.train_fps"),
        "vae_stride": _triple(pre.get("vae_stride", [4, 8, 8]), source, f"{_PRE}.vae_stride"),
        "vae_patch_size": _triple(pre.get("vae_patch_size", [1, 2, 2]), source, f"{_PRE}.vae_patch_size"),
        "keep_last": keep_last,
    }
    for axis in (1, 2):
        if (frames["vae_stride"][axis] * frames["vae_patch_size"][axis]) % 8:
            raise _fail(
                source, f"{_PRE}.vae_stride", "the sizes it gives must be multiples of the mask's 8 x 8 patches"
            )
    plan.pipeline = _pipeline(pre, source)
    known = {
        *_TYPES,
        *_NO_EFFECT,
        "num_frames",
        "max_hxw",
        "zero_start",
        "keep_last",
        "train_fps",
        "vae_stride",
        "vae_patch_size",
        "train_pipeline",
    }
    unknown = sorted(set(pre) - known)
    if unknown:
        raise _fail(source, f"{_PRE}.{unknown[0]}", "not applied by extract-features")
    noted = sorted(set(pre) & set(_NO_EFFECT))
    if noted:
        print(f"note: {source}: `{_PRE}` {noted} have no effect (nor in MindSpeed MM's VACEVideoProcessor)")
    print(f"note: {source}: `{_PRE}.video_reader_type` DecordVideo: clips are read with PyAV here")
    tok = _text(param, source, plan)
    plan.vae, plan.text_encoder, plan.tokenizer = component_paths(model_config, tok, vae, text_encoder, tokenizer)
    if model_config.get("task", "vace") != "vace":
        raise ConfigError(f"{model_source}: `task: {model_config.get('task')}`: a VACE data config extracts `vace`")
    check_ae_keys(model_config.get("ae"), model_source)
    _check_vae(plan.vae)
    seen: dict[str, str] = {}
    for annotation, folder, written in combine_lines(data_path):
        for number, record in annotation_records(annotation):
            entry = _record(record, f"{annotation}:{number}", folder, written or str(folder))
            if entry.name in seen:
                raise ConfigError(
                    f"{entry.where}: its feature file {entry.name} (the MD5 of `cap`) is also that of "
                    f"{seen[entry.name]} (same caption)"
                )
            seen[entry.name] = entry.where
            plan.records.append(entry)
    if not plan.records:
        raise ConfigError(f"{data_path}: no records")
    for entry in plan.records:
        _frames(entry, frames, source)
    check_outputs(output, ["data.jsonl", *(f"features/{e.name}" for e in plan.records)])
    return plan


def plan_any_extraction(
    data: Path,
    model: Path | None,
    output: Path,
    vae: str | None = None,
    text_encoder: str | None = None,
    tokenizer: str | None = None,
    image_encoder: str | None = None,
) -> Any:
    """The plan of ``extract-features``: a VACE data config (:func:`is_vace`) gives a :class:`VaceExtractionPlan`,
    any other Wan 2.1's :class:`~lightning_mm.mindspeed.feature_launch.ExtractionPlan`."""
    from lightning_mm.mindspeed.feature_launch import plan_extraction, read_json_config

    config = read_json_config(data, "--data")
    if not is_vace(config):
        return plan_extraction(data, model, output, vae, text_encoder, tokenizer, image_encoder)
    if image_encoder is not None:
        raise ConfigError("--image-encoder: VACE features have no image encoder")
    model_config = read_json_config(model, "--model") if model is not None else {}
    return plan_vace_extraction(config, str(data), model_config, str(model), output, vae, text_encoder, tokenizer)
