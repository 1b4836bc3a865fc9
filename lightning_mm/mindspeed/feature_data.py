"""MindSpeed MM's ``dataset_type: feature`` (the Wan recipes' ``feature_data.json``): precomputed video latents and
text embeddings, one ``.pt`` file per sample.

``basic_parameters.data_path`` is a JSON-lines file whose records name their feature file in ``file`` (relative to
``basic_parameters.data_folder``, inside which it must resolve); other record keys (the caption ``cap``, the source
video ``path`` that MindSpeed MM's ``_write_data_info`` keeps, absolute in ``data_storage_mode: combine``) are metadata
and not read, as MindSpeed MM's ``FeatureDataset`` (``mindspeed_mm/data/datasets/feature_dataset.py``) reads only
``file``. Each feature file is a ``torch.save`` dict, loaded with ``weights_only=True``, with MindSpeed MM's keys
``video`` (the VAE latents, ``(C, F, H, W)``), ``prompt_ids`` (the text encoder's embeddings, ``(L, D)``) and optionally
``prompt_mask`` ``(L,)``; image-to-video features add MindSpeed MM's ``i2v_clip_feature`` (the CLIP image encoder's
``hidden_states[-2]``, diffusers' ``encoder_hidden_states_image``) and ``i2v_vae_feature`` (the first-frame mask and
latents concatenated on the channels, which MindSpeed MM's ``WanDiT`` and diffusers' ``WanTransformer3DModel``
concatenate to the noisy latents), read as the batch keys ``image_embeds`` and ``condition_latents``. Wan VACE features
(MindSpeed MM's ``get_vace_feature.py``, whose files hold ``video``, ``prompt_ids``, ``prompt_mask`` and
``vace_context``: the inactive and reactive control-video latents and the 8x8 mask, 96 channels) add ``vace_context``,
read as the batch key ``control_latents``; MindSpeed MM's ``FeatureDataset`` passes it on among the "remaining keys" of
a feature file and ``VACEModel.forward`` takes it. A data config whose ``preprocess_parameters.video_processor_type`` is
``VACEVideoProcessor`` (MindSpeed MM's VACE ``feature_data.json``) names VACE features: each file must hold
``vace_context`` (the first one is checked when the dataset is set up; a later one without it is a bad record).
HunyuanVideo 1.5's features (two text encoders) hold ``prompt_ids`` and ``prompt_mask`` as lists, the MLLM's and byT5's
outputs each with a leading axis of 1, as MindSpeed MM's ``get_sora_feature.py`` saves them; they are read as
``prompt_embeds`` / ``prompt_mask`` and ``prompt_embeds_2`` / ``prompt_mask_2``, the batch keys of
:class:`~lightning_mm.modules.hunyuan15_module.MMHunyuan15Module`; its image-to-video features add ``cond_latents`` and
``vision_states`` (the first frame's latents and mask, its SigLIP states), read as ``condition_latents`` and
``image_embeds``. A sample is ``{"latents", "prompt_embeds", ...}``, the batch keys of
:class:`~lightning_mm.modules.wan_module.MMWanModule`. Another key in a feature file is an error naming it.

The features were made by MindSpeed MM's feature extraction with the ``preprocess_parameters`` and
``tokenizer_config`` of the config (frames, resolution, tokenizer); those keys are accepted and logged as not
applied here. With ``basic_parameters.vae_path`` (a key of this project) a record's ``path`` instead names a raw
video (relative to ``data_folder``) and its ``file`` holds the text features only: the video is decoded and encoded
by the frozen ``AutoencoderKLWan`` saved at ``vae_path`` with ``preprocess_parameters`` ``num_frames``,
``frame_interval``, ``max_height`` and ``max_width`` (:mod:`lightning_mm.data.wan_video`).

Bad records are found when the dataset is set up and skipped with their ``file:line`` in the split's
:class:`~lightning_mm.data.record_files.DataReport` (an error in strict mode), as on the other data paths: a line
that is not JSON, a feature file or video that is missing or outside ``data_folder``, and a video that the probe
of :func:`~lightning_mm.data.wan_video.probe_video` refuses (empty, undecodable, fewer frames than
``num_frames`` needs, frames larger than ``MAX_SOURCE_SIDE``). A record that still fails when it is read (a stream
corrupt past its first frame, a feature file changed since) is replaced by the next good one and counted
(:class:`~lightning_mm.data.replacing.ReplacingDataset`), so every rank keeps its number of batches.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_mm._utils.distributed import rank_zero_info
from lightning_mm.checkpoint.safe import load_weights_only
from lightning_mm.data.data_config import DataConfigError
from lightning_mm.data.record_files import DataError, DataReport
from lightning_mm.data.replacing import ReplacingDataset
from lightning_mm.errors import ConfigError
from lightning_mm.mindspeed.data_keys import check_keys, strict_or_warn

__all__ = ["FEATURE_KEYS", "WanFeatureDataset", "build_feature_datasets", "collate_features"]

FEATURE_KEYS = {
    "video": "latents",
    "prompt_ids": "prompt_embeds",
    "prompt_mask": "prompt_mask",
    "latents": "latents",
    "prompt_embeds": "prompt_embeds",
    "image_embeds": "image_embeds",
    "condition_latents": "condition_latents",
    "i2v_clip_feature": "image_embeds",
    "i2v_vae_feature": "condition_latents",
    "vace_context": "control_latents",
    "control_latents": "control_latents",
    "prompt_ids_2": "prompt_embeds_2",
    "prompt_mask_2": "prompt_mask_2",
    "prompt_embeds_2": "prompt_embeds_2",
    "cond_latents": "condition_latents",
    "vision_states": "image_embeds",
}
"""A feature file's key (MindSpeed MM's names, or the batch names) -> the sample key."""

_DATASET_KEYS = (
    "dataset_type",
    "basic_parameters",
    "preprocess_parameters",
    "use_text_processer",
    "enable_text_preprocessing",
    "tokenizer_config",
)
_BASIC_KEYS = ("data_path", "data_folder", "vae_path")
_VIDEO_KEYS = ("num_frames", "max_height", "max_width")
VACE_PROCESSOR = "VACEVideoProcessor"
"""The ``preprocess_parameters.video_processor_type`` of MindSpeed MM's VACE data configs: VACE features."""
_NOT_APPLIED = ("preprocess_parameters", "use_text_processer", "enable_text_preprocessing", "tokenizer_config")


class WanFeatureDataset(ReplacingDataset):
    """The feature files ``paths`` (checked to exist), read one sample at a time; ``records`` are their JSON
    records (for the batch grouping keys), ``where`` their ``file:line`` (for the report of a record that fails
    when it is read: the next good one takes its place, see :class:`ReplacingDataset`)."""

    failed_in_a_row = "feature records in a row failed to read"
    nothing_readable = "no feature record could be read"
    broken = "the feature files or the videos are broken"

    def __init__(
        self,
        paths: list[Path],
        records: list[Mapping[str, Any]] | None = None,
        videos: list[Path | None] | None = None,
        video: VideoSettings | None = None,
        where: list[str] | None = None,
        report: DataReport | None = None,
        strict: bool = False,
        vace: bool = False,
    ) -> None:
        self.paths = list(paths)
        self.vace = vace
        super().__init__(list(range(len(self.paths))), report if report is not None else DataReport("train"), strict)
        self.json_records = list(records) if records is not None else [{} for _ in self.paths]
        self.videos = list(videos) if videos is not None else [None] * len(self.paths)
        self.wheres = list(where) if where is not None else [str(p) for p in self.paths]
        if video is None and any(v is not None for v in self.videos):
            raise ConfigError("video records need VideoSettings")
        self.video = video

    def where(self, record: Any) -> str:
        return self.wheres[record]

    def group_keys(self, group_by: str) -> list[str]:
        """Each sample's size for MindSpeed MM's ``group_data`` (``"data"``: the record's ``sample_size``, else
        ``len(sample_frame_index)`` x ``resolution.sample_height`` x ``sample_width``) or ``group_frame``
        (``"frame"``: ``sample_num_frames``). When some record lacks them, every sample's key is its latents' shape
        (``group_data``) or latent frame count (``group_frame``), read from the feature files (logged)."""
        keys = [_record_key(record, group_by) for record in self.json_records]
        if all(key is not None for key in keys):
            return [str(key) for key in keys]
        missing = "sample_size" if group_by == "data" else "sample_num_frames"
        rank_zero_info(
            f"WanFeatureDataset: a record has no {missing}"
            "; grouping the batches by the latents' shape read from the feature files"
        )
        shapes = [tuple(self[i]["latents"].shape) for i in range(len(self))]
        return ["x".join(map(str, s[1:] if group_by == "data" else s[1:2])) for s in shapes]

    def sample(self, record: Any) -> dict[str, torch.Tensor]:
        """The sample of the record at index ``record``; raises :class:`DataError` naming the file."""
        path = self.paths[record]
        data = load_weights_only(path)
        if not isinstance(data, Mapping):
            raise DataError(f"{path}: a feature file must hold a dict, got {type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in FEATURE_KEYS)
        if unknown:
            raise DataError(f"{path}: unknown feature key(s) {unknown} (known: {sorted(FEATURE_KEYS)})")
        sample: dict[str, torch.Tensor] = {}
        data = _split_text_encoders(dict(data), path)
        for key, value in data.items():
            if value is not None and FEATURE_KEYS[key] in sample:
                raise DataError(f"{path}: `{key}` and another key both give `{FEATURE_KEYS[key]}`")
            if value is not None:
                sample[FEATURE_KEYS[key]] = value
        video = self.videos[record]
        if video is not None:
            if "latents" in sample:
                raise DataError(f"{path}: has video latents but its record names the video {video.name!r} too")
            assert self.video is not None
            sample["latents"] = self.video.latents(video)
        if self.vace and not isinstance(sample.get("control_latents"), torch.Tensor):
            raise DataError(
                f"{path}: no `vace_context` tensor (the VACE control latents; the data config's "
                f"video_processor_type {VACE_PROCESSOR} names VACE features)"
            )
        if "control_latents" in sample and sample["control_latents"].ndim != 4:
            raise DataError(f"{path}: `vace_context` must be (C, F, H, W), got {list(sample['control_latents'].shape)}")
        for key in ("latents", "prompt_embeds"):
            if not isinstance(sample.get(key), torch.Tensor):
                raise DataError(
                    f"{path}: no `{key}` tensor (MindSpeed MM's `video` / `prompt_ids`; a record's `path` is a video "
                    "to encode only with basic_parameters.vae_path)"
                )
        if sample["latents"].ndim != 4 or sample["prompt_embeds"].ndim != 2:
            raise DataError(
                f"{path}: latents must be (C, F, H, W) and prompt embeddings (L, D), got "
                f"{list(sample['latents'].shape)} and {list(sample['prompt_embeds'].shape)}"
            )
        return sample


def _split_text_encoders(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """Two text encoders' features (HunyuanVideo 1.5: MindSpeed MM's ``get_sora_feature.py`` saves ``prompt_ids``
    and ``prompt_mask`` as lists, one entry per encoder, each with a leading axis of 1) as ``prompt_ids`` /
    ``prompt_ids_2`` and ``prompt_mask`` / ``prompt_mask_2``."""
    for key in ("prompt_ids", "prompt_mask"):
        value = data.get(key)
        if not isinstance(value, (list, tuple)):
            continue
        if len(value) != 2 or not all(isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == 1 for v in value):
            raise DataError(
                f"{path}: `{key}` is a list: it must hold two text encoders' tensors (MLLM, byT5), each with a "
                f"leading axis of 1, got {[getattr(v, 'shape', type(v).__name__) for v in value]}"
            )
        data[key], data[f"{key}_2"] = value[0][0], value[1][0]
    return data


@dataclass
class VideoSettings:
    """How a record's video becomes latents (:mod:`lightning_mm.data.wan_video`)."""

    vae: Any  # FrozenWanVAE
    num_frames: int
    height: int
    width: int
    frame_interval: int = 1

    def probe(self, video: Path) -> str | None:
        """Why ``video`` cannot give the frames (``None``: it can), :func:`~.wan_video.probe_video`."""
        from lightning_mm.data.wan_video import probe_video

        return probe_video(video, self.num_frames, self.frame_interval)

    def latents(self, video: Path) -> torch.Tensor:
        from lightning_mm.data.wan_video import decode_model_frames

        frames = decode_model_frames(video, self.num_frames, self.frame_interval, self.height, self.width)
        return self.vae.encode(frames)


def _video_settings(
    param: Mapping[str, Any], basic: Mapping[str, Any], base_dir: Path, dp: str, source: str
) -> VideoSettings:
    from lightning_mm.data.wan_video import FrozenWanVAE

    if not isinstance(basic.get("vae_path"), str):
        raise _fail(
            source,
            dp + "basic_parameters.vae_path",
            "missing or not a path: records name videos (`path`), encoded by the AutoencoderKLWan saved there",
        )
    pre = param.get("preprocess_parameters")
    if not isinstance(pre, Mapping):
        raise _fail(
            source, dp + "preprocess_parameters", "missing: records name videos; give num_frames, max_height, max_width"
        )
    values = {}
    for key in (*_VIDEO_KEYS, "frame_interval"):
        value = pre.get(key, 1 if key == "frame_interval" else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _fail(source, dp + f"preprocess_parameters.{key}", f"expected an integer >= 1, got {value!r}")
        values[key] = value
    others = sorted(k for k in pre if k not in (*_VIDEO_KEYS, "frame_interval"))
    if others:
        rank_zero_info(
            f"{source}: `{dp}preprocess_parameters` {others} are not applied (frames are taken from the "
            "start, short-side resized and centre-cropped)"
        )
    return VideoSettings(
        FrozenWanVAE((base_dir / basic["vae_path"]).resolve()),
        values["num_frames"],
        values["max_height"],
        values["max_width"],
        values["frame_interval"],
    )


def _probed(settings: VideoSettings, video: Path, where: str, report: DataReport) -> bool:
    """Whether ``video`` passes the probe; if not, its record is a problem of ``report``."""
    problem = settings.probe(video)
    if problem is not None:
        report.problems.append(f"{where}: video {video.name!r}: {problem}")
    return problem is None


def _record_key(record: Mapping[str, Any], group_by: str) -> Any:
    if group_by == "frame":
        return record.get("sample_num_frames")
    if record.get("sample_size"):
        return record["sample_size"]
    frames, resolution = record.get("sample_frame_index"), record.get("resolution")
    if (
        isinstance(frames, list)
        and isinstance(resolution, Mapping)
        and {"sample_height", "sample_width"} <= set(resolution)
    ):
        return f"{len(frames)}x{resolution['sample_height']}x{resolution['sample_width']}"
    return None


def collate_features(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack the samples' tensors; samples of one batch must have the same keys and shapes."""
    keys = set(samples[0])
    out = {}
    for key in sorted(keys):
        shapes = {tuple(s[key].shape) for s in samples if key in s}
        if any(set(s) != keys for s in samples) or len(shapes) > 1:
            raise DataError(
                f"a batch mixes samples with different `{key}` (shapes {sorted(shapes)}) or keys; use "
                "micro-batch size 1 or features of one resolution and length"
            )
        out[key] = torch.stack([s[key] for s in samples])
    return out


def _check_vace_file(path: Path) -> None:
    """The first feature file of a VACE data config holds ``vace_context`` (else nothing of it trains as VACE)."""
    data = load_weights_only(path)
    if not isinstance(data, Mapping) or not isinstance(
        data.get("vace_context", data.get("control_latents")), torch.Tensor
    ):
        raise DataError(
            f"{path}: no `vace_context` tensor (the VACE control latents of MindSpeed MM's get_vace_feature.py; "
            f"the data config's video_processor_type {VACE_PROCESSOR} names VACE features)"
        )


def _fail(source: str, key: str, message: str) -> DataConfigError:
    return DataConfigError(f"{source}: `{key}`: {message}")


def build_feature_datasets(
    dataset_param: Mapping[str, Any],
    collate_param: Mapping[str, Any],
    base_dir: Path,
    source: str,
    strict: bool,
    prefix: str = "",
) -> tuple[dict[str, Any], Callable[[list[dict]], dict], dict[str, DataReport]]:
    """``({"train": WanFeatureDataset, ...}, collate, reports)`` for a ``dataset_type: feature`` section."""
    dp = prefix + "dataset_param."
    param = check_keys(dataset_param, _DATASET_KEYS, dp, source)
    if collate_param:
        raise _fail(source, prefix + "dataloader_param.collate_param", "not used with dataset_type: feature")
    basic = check_keys(param.get("basic_parameters"), _BASIC_KEYS, dp + "basic_parameters.", source)
    if not isinstance(basic.get("data_path"), str):
        raise _fail(source, dp + "basic_parameters.data_path", "missing: the JSON-lines file of the feature records")
    data_path = (base_dir / basic["data_path"]).resolve()
    folder_value = basic.get("data_folder") or str(Path(basic["data_path"]).parent)
    folder = (base_dir / folder_value).resolve()
    if not data_path.is_file():
        raise _fail(source, dp + "basic_parameters.data_path", f"'{data_path}' does not exist")
    if not folder.is_dir():
        raise _fail(source, dp + "basic_parameters.data_folder", f"'{folder}' is not a directory")
    encodes_videos = "vae_path" in basic
    report = DataReport("train")
    paths: list[Path] = []
    records: list[Mapping[str, Any]] = []
    videos: list[Path | None] = []
    where: list[str] = []
    for number, line in enumerate(data_path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        report.total += 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            report.problems.append(f"{data_path}:{number}: not JSON ({err.msg})")
            continue
        file = record.get("file") if isinstance(record, dict) else None
        if not isinstance(file, str) or not file:
            report.problems.append(f"{data_path}:{number}: no `file` (the feature file of the record)")
            continue
        path = (folder / file).resolve()
        # Without vae_path, `path` is MindSpeed MM's metadata (the source video), not read.
        video = record.get("path") if encodes_videos else None
        video_path = (folder / video).resolve() if isinstance(video, str) and video else None
        if video is not None and video_path is None:
            report.problems.append(f"{data_path}:{number}: `path` must name a video file, got {video!r}")
        elif video_path is not None and not video_path.is_relative_to(folder):
            report.problems.append(f"{data_path}:{number}: `path` {video!r} resolves outside {folder}")
        elif video_path is not None and not video_path.is_file():
            report.problems.append(f"{data_path}:{number}: video {video!r} does not exist in {folder}")
        elif not path.is_relative_to(folder):
            report.problems.append(f"{data_path}:{number}: `file` {file!r} resolves outside {folder}")
        elif not path.is_file():
            report.problems.append(f"{data_path}:{number}: feature file {file!r} does not exist in {folder}")
        else:
            paths.append(path)
            records.append(record)
            videos.append(video_path)
            where.append(f"{data_path}:{number}")
    settings = None
    if any(v is not None for v in videos):
        settings = _video_settings(param, basic, base_dir, dp, source)
        kept = [i for i, video in enumerate(videos) if video is None or _probed(settings, video, where[i], report)]
        paths, records = [paths[i] for i in kept], [records[i] for i in kept]
        videos, where = [videos[i] for i in kept], [where[i] for i in kept]
        not_applied = [k for k in _NOT_APPLIED if k in param and k != "preprocess_parameters"]
    else:
        not_applied = [k for k in _NOT_APPLIED if k in param]
    strict_or_warn(report, strict, source)
    if not paths:
        raise DataError(f"{source}: no usable feature record in {data_path}:\n{report.summary()}")
    for key in not_applied:
        rank_zero_info(f"{source}: `{dp}{key}` is not applied: the text (and video) features are precomputed")
    pre = param.get("preprocess_parameters")
    vace = isinstance(pre, Mapping) and pre.get("video_processor_type") == VACE_PROCESSOR
    dataset = WanFeatureDataset(paths, records, videos, settings, where, report, strict, vace)
    if vace:
        _check_vace_file(paths[0])
    splits = {"train": dataset, "val": None, "test": None}
    return splits, collate_features, {"train": report}
