"""MindSpeed MM's ``dataset_type: huggingface`` (sharegpt records, the model's own processor) as Datasets.

Every key of ``preprocess_parameters``, ``basic_parameters`` and ``attr`` (MindSpeed MM's ``ProcessorArguments``,
``DataArguments`` and ``DatasetAttr``) is honoured, accepted as having no effect here (logged once, with why), or
refused by name (see :data:`_NO_EFFECT` and :data:`_FIXED`); an unknown key suggests the nearest. The records and
their Dataset are in :mod:`lightning_mm.mindspeed.chat_dataset`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from lightning_mm._utils.distributed import rank_zero_info
from lightning_mm._utils.yaml_io import load_mapping, short_repr
from lightning_mm.data.data_config import DataConfigError
from lightning_mm.data.record_files import DataError, DataReport
from lightning_mm.mindspeed.chat_dataset import ChatAttr, ChatDataset, read_chat_records
from lightning_mm.mindspeed.data_keys import check_keys, strict_or_warn
from lightning_mm.mindspeed.keys import KeyReader

__all__ = ["build_huggingface_datasets", "packing_settings"]

_PREPROCESS_KEYS = (
    "model_name_or_path",
    "use_fast_tokenizer",
    "split_special_tokens",
    "image_resolution",
    "video_resolution",
    "image_max_pixels",
    "image_min_pixels",
    "video_max_pixels",
    "video_min_pixels",
    "video_fps",
    "video_maxlen",
    "image_do_pan_and_scan",
    "crop_to_patches",
    "use_audio_in_video",
    "audio_sampling_rate",
    "trust_remote_code",
    "fix_mistral_regex",
)
_BASIC_KEYS = (
    "cache_dir",
    "template",
    "enable_thinking",
    "dataset_dir",
    "dataset",
    "cutoff_len",
    "train_on_prompt",
    "mask_history",
    "streaming",
    "overwrite_cache",
    "preprocessing_batch_size",
    "preprocessing_num_workers",
    "max_samples",
    "tool_format",
    "val_dataset",
    "val_max_samples",
    "val_rate",
    "packing",
    "neat_packing",
    "preprocess_on_fly",
    "async_preprocess",
    "async_preprocess_buffer_size",
    "use_pmcc_data",
    "chat_template",
    "stage",
)
_ATTR_KEYS = (
    "packing",
    "ranking",
    "pretrain",
    "system",
    "images",
    "videos",
    "audios",
    "prompt",
    "query",
    "response",
    "history",
    "messages",
    "role_tag",
    "content_tag",
    "user_tag",
    "assistant_tag",
    "observation_tag",
    "function_tag",
    "system_tag",
    "chosen",
    "rejected",
    "formatting",
)
_NO_EFFECT = {
    "cache_dir": "MindSpeed MM caches its offline preprocessing there; here records are processed as they are read",
    "overwrite_cache": "it only controls MindSpeed MM's preprocessing cache; there is none here",
    "preprocessing_batch_size": "it sizes MindSpeed MM's offline preprocessing; here records are processed one "
    "by one in the loader (its workers are MMDataModule(num_workers=...))",
    "preprocessing_num_workers": "it sizes MindSpeed MM's offline preprocessing; the loader's workers are "
    "MMDataModule(num_workers=...)",
    "preprocess_on_fly": "records are always processed on the fly here",
    "async_preprocess_buffer_size": "it only applies to streaming, which is not supported here",
    "audio_sampling_rate": "audio is not supported here",
    "image_resolution": "MindSpeed MM's huggingface dataset does not read it either (images are bounded by "
    "image_max_pixels/image_min_pixels)",
    "video_resolution": "MindSpeed MM's huggingface dataset does not read it either",
}
# key -> (the only accepted value besides null, why another value is refused)
_FIXED = {
    "use_fast_tokenizer": (True, "the labels are placed with the fast tokenizer's character offsets"),
    "split_special_tokens": (
        False,
        "the chat template's special tokens (<|im_start|>, <|image_pad|>, ...) must stay single tokens",
    ),
    "image_do_pan_and_scan": (False, "pan and scan is Gemma 3's, not supported here"),
    "crop_to_patches": (False, "cropping to patches is InternVL's (dataset_type: multimodal)"),
    "use_audio_in_video": (False, "audio is not supported here"),
    "trust_remote_code": (False, "the processor is loaded without remote code here"),
    "fix_mistral_regex": (
        False,
        "Mistral 3 is not supported here (Transformers 5's PixtralProcessor needs torchvision)",
    ),
    "streaming": (False, "streaming is not supported here: records are read and checked up front"),
    "async_preprocess": (False, "it only applies to streaming, which is not supported here"),
    "use_pmcc_data": (False, "PMCC data is not supported here"),
    "stage": ("sft", "only supervised fine-tuning (stage: sft) is supported here"),
    "tool_format": (None, "tool calling is not supported here"),
    "val_rate": (None, "MindSpeed MM's huggingface dataset does not split by val_rate; give val_dataset"),
    "ranking": (False, "pairwise (ranking) data is not supported here"),
    "pretrain": (False, "pretraining data is not supported here"),
    "audios": (None, "audio is not supported here"),
    "formatting": ("sharegpt", "only sharegpt records are supported here"),
    **{
        k: (None, "alpaca and pairwise columns are not supported here (formatting: sharegpt)")
        for k in ("prompt", "query", "response", "history", "chosen", "rejected")
    },
}
_ATTR_DEFAULTS = {
    "messages": "conversations",
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
    "system": None,
    "images": None,
    "videos": None,
}


def packing_settings(
    dataset_param: Mapping[str, Any], source: str, prefix: str = "", max_tokens_per_rank: int | None = None
) -> tuple[bool, int | None]:
    """``(packing, max_tokens_per_rank)`` from ``basic_parameters``: ``neat_packing`` (packing without attention
    across samples, MindSpeed MM's native route) packs rows of up to ``cutoff_len`` tokens, unless
    ``max_tokens_per_rank`` is given (it wins)."""
    basic = dataset_param.get("basic_parameters") or {}
    bp = f"{prefix}dataset_param.basic_parameters."
    if not isinstance(basic, Mapping):
        return False, None
    neat = _flag(basic, "neat_packing", False, bp, source)
    plain = basic.get("packing")
    if plain is not None and not isinstance(plain, bool):
        raise DataConfigError(f"{source}: `{bp}packing`: expected true or false, got {short_repr(plain)}")
    if plain and not neat:
        raise DataConfigError(
            f"{source}: `{bp}packing`: packing whose samples attend to each other is not supported "
            "here; set `neat_packing: true` (samples packed, each attending only to itself)"
        )
    if not neat:
        return False, max_tokens_per_rank
    budget = (
        max_tokens_per_rank if max_tokens_per_rank is not None else _int(basic, "cutoff_len", None, bp, source, low=1)
    )
    if budget is None:
        raise DataConfigError(
            f"{source}: `{bp}neat_packing`: packed rows need a token budget: set `{bp}cutoff_len` "
            "or MMDataModule(max_tokens_per_rank=...)"
        )
    return True, budget


def _check_fixed(section: Mapping[str, Any], prefix: str, source: str) -> None:
    for key, (allowed, why) in _FIXED.items():
        value = section.get(key)
        if value is None or value == allowed or (allowed is None and not value):
            continue
        if key in section:
            raise DataConfigError(f"{source}: `{prefix}{key}`: {short_repr(section[key])} is not supported: {why}")


def _path(base: Path, value: Any, key: str, source: str, want: str) -> Path:
    if not isinstance(value, str) or not value:
        raise DataConfigError(f"{source}: `{key}`: expected a path, got {short_repr(value)}")
    path = (base / value).resolve()
    if want == "dir" and not path.is_dir():
        raise DataConfigError(f"{source}: `{key}`: directory not found: {path}")
    if want == "file" and not path.is_file():
        raise DataConfigError(f"{source}: `{key}`: file not found: {path}")
    return path


def _files(base: Path, value: Any, key: str, source: str) -> tuple[Path, ...]:
    if not isinstance(value, str) or not value.strip():
        raise DataConfigError(f"{source}: `{key}`: expected a file or comma-separated files, got {short_repr(value)}")
    return tuple(_path(base, name.strip(), key, source, "file") for name in value.split(","))


def _int(
    section: Mapping[str, Any], key: str, default: int | None, prefix: str, source: str, low: int = 0
) -> int | None:
    value = section.get(key, default)
    return None if value is None else KeyReader(source, prefix, DataConfigError).int_at_least(value, key, low)


def _flag(section: Mapping[str, Any], key: str, default: bool, prefix: str, source: str) -> bool:
    return KeyReader(source, prefix, DataConfigError).flag(section.get(key, default), key, default)


def _attr(section: Mapping[str, Any], prefix: str, source: str) -> ChatAttr:
    values = {k: section.get(k, v) for k, v in _ATTR_DEFAULTS.items()}
    for key, value in values.items():
        if value is not None and not isinstance(value, str):
            raise DataConfigError(f"{source}: `{prefix}{key}`: expected a column or tag name, got {short_repr(value)}")
    for key in ("messages", "role_tag", "content_tag", "user_tag", "assistant_tag"):
        if not values[key]:
            raise DataConfigError(f"{source}: `{prefix}{key}`: a name is required")
    return ChatAttr(**values)


def _video_settings(pre: Mapping[str, Any], pp: str, source: str) -> dict[str, Any]:
    """``video_fps``, ``video_maxlen``, ``video_max_pixels``, ``video_min_pixels`` (MindSpeed MM's defaults)."""
    fps = pre.get("video_fps", 2.0)
    fps = 2.0 if fps is None else fps
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
        raise DataConfigError(f"{source}: `{pp}video_fps`: expected a number > 0, got {short_repr(fps)}")
    maxlen = _int(pre, "video_maxlen", 128, pp, source, low=1) or 128
    max_pixels = _int(pre, "video_max_pixels", 256 * 256, pp, source, low=1) or 256 * 256
    min_pixels = _int(pre, "video_min_pixels", 16 * 16, pp, source) or 0
    if min_pixels > max_pixels:
        raise DataConfigError(
            f"{source}: `{pp}video_min_pixels`: {min_pixels} must be at most video_max_pixels {max_pixels}"
        )
    return {
        "video_fps": float(fps),
        "video_maxlen": maxlen,
        "video_max_pixels": max_pixels,
        "video_min_pixels": min_pixels,
    }


def _video_processor(template: Any, model_dir: Path, model_type: str) -> tuple[Any, str | None]:
    """(the video processor or ``None``, why videos are refused or ``None``) for a MindSpeed MM template."""
    from lightning_mm.hf.qwen_video import VIDEO_FAMILIES, QwenVideoProcessor, load_video_settings

    if template.video is None:
        return None, template.no_video
    if model_type not in VIDEO_FAMILIES:
        return None, f"model_type {model_type!r} has no Qwen-VL video processor here"
    try:
        settings = load_video_settings(model_dir, model_type)
    except (OSError, ValueError) as err:
        return None, f"the video processor's settings in {model_dir}: {err}"
    return QwenVideoProcessor(settings), None


# ----------------------------------------------------------------------------------------------- builder
def _chat_template(base: Path, basic: Mapping[str, Any], bp: str, source: str) -> str | None:
    """``basic_parameters.chat_template``: a Jinja file (at most 1 MiB of UTF-8) that MindSpeed MM's FSDP trainer
    renders the conversations with, before ``template``."""
    if basic.get("chat_template") is None:
        return None
    chat_file = _path(base, basic["chat_template"], bp + "chat_template", source, "file")
    with open(chat_file, "rb") as handle:
        raw = handle.read((1 << 20) + 1)
    try:
        chat_template = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataConfigError(f"{source}: `{bp}chat_template`: {chat_file} is not UTF-8 text") from None
    if len(raw) > 1 << 20:
        raise DataConfigError(f"{source}: `{bp}chat_template`: {chat_file} is larger than 1 MiB")
    if basic.get("template") is not None:
        rank_zero_info(
            f"{source}: `{bp}template` is not used: `{bp}chat_template` {chat_file} renders the "
            "conversations (as in MindSpeed MM)"
        )
    return chat_template


def _sample_builder(
    processor: Any,
    name: Any,
    template: Any,
    chat_template: str | None,
    settings: dict[str, Any],
    preprocess: tuple[Mapping[str, Any], str, str],
    model_dir: Path,
    model_type: str,
) -> tuple[Any, str | None]:
    """The sample builder of the dataset and the note on videos: MindSpeed MM's own template (its samples, built as
    it builds them) or the model's own chat template (``template: null``, or a ``chat_template`` file)."""
    from lightning_mm.hf.chat_samples import ChatSampleBuilder
    from lightning_mm.hf.mindspeed_samples import MINDSPEED_FORMATS, MindSpeedSampleBuilder

    if name in MINDSPEED_FORMATS:
        video, video_note = _video_processor(MINDSPEED_FORMATS[name], model_dir, model_type)
        builder = MindSpeedSampleBuilder(
            processor, MINDSPEED_FORMATS[name], **settings, **_video_settings(*preprocess), video_processor=video
        )
        return builder, video_note
    note = (
        "videos are built only with MindSpeed MM's templates here (basic_parameters.template: qwen2vl, "
        "qwen3_vl, qwen3_vl_nothink, qwen3_6 or qwen2_omni), not with the model's own chat template"
    )
    return ChatSampleBuilder(processor, template, chat_template=chat_template, **settings), note


def build_huggingface_datasets(
    dataset_param: Mapping[str, Any],
    collate_param: Mapping[str, Any],
    base_dir: Path,
    source: str,
    strict: bool,
    *,
    allow_outside_data_root: bool = False,
    prefix: str = "",
) -> tuple[dict[str, Dataset | None], Callable[[list[dict]], dict], dict[str, DataReport]]:
    """``({"train", "val", "test"}, collate_fn, reports)`` of a ``dataset_type: huggingface`` dataset_param."""
    from lightning_mm.hf.chat_collate import ChatCollator
    from lightning_mm.hf.chat_samples import template_for
    from lightning_mm.hf.vlm_processor import ProcessorLoadError, load_vlm_processor

    dp = prefix + "dataset_param."
    base = Path(base_dir).resolve()
    pre = check_keys(
        dataset_param.get("preprocess_parameters"), _PREPROCESS_KEYS, dp + "preprocess_parameters.", source
    )
    basic = check_keys(dataset_param.get("basic_parameters"), _BASIC_KEYS, dp + "basic_parameters.", source)
    attr_section = check_keys(dataset_param.get("attr"), _ATTR_KEYS, dp + "attr.", source)
    pp, bp, ap = dp + "preprocess_parameters.", dp + "basic_parameters.", dp + "attr."
    _check_fixed(pre, pp, source)
    _check_fixed(basic, bp, source)
    _check_fixed(attr_section, ap, source)
    for section, sp in ((pre, pp), (basic, bp)):
        for key in section:
            if key in _NO_EFFECT:
                rank_zero_info(f"{source}: `{sp}{key}` has no effect here: {_NO_EFFECT[key]}")

    model_dir = _path(base, pre.get("model_name_or_path"), pp + "model_name_or_path", source, "dir")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise DataConfigError(f"{source}: `{pp}model_name_or_path`: no config.json in {model_dir}")
    model_type = load_mapping(config_file, error=DataConfigError).get("model_type")
    chat_template = _chat_template(base, basic, bp, source)
    try:
        template = template_for(None if chat_template is not None else basic.get("template"), model_type)
    except ValueError as err:
        raise DataConfigError(f"{source}: `{bp}template`: {err}") from None
    for key in ("model_name", "collator_id"):
        name = collate_param.get(key)
        if name is not None and name not in template.collate_names:
            raise DataConfigError(
                f"{source}: `{prefix}dataloader_param.collate_param.{key}`: {short_repr(name)} "
                f"does not fit a {model_type} model (expected {' or '.join(template.collate_names)})"
            )
    cutoff_len = _int(basic, "cutoff_len", 1024, bp, source, low=1)  # MindSpeed MM's DataArguments default
    min_pixels = _int(pre, "image_min_pixels", 32 * 32, pp, source)
    max_pixels = _int(pre, "image_max_pixels", 768 * 768, pp, source, low=1)
    if min_pixels is None or max_pixels is None or min_pixels > max_pixels:
        raise DataConfigError(
            f"{source}: `{pp}image_min_pixels`: {min_pixels} must be at most image_max_pixels {max_pixels}"
        )
    flags = {
        k: _flag(basic, k, d, bp, source)
        for k, d in (("train_on_prompt", False), ("mask_history", False), ("enable_thinking", True))
    }
    root = _path(base, basic.get("dataset_dir", "data"), bp + "dataset_dir", source, "dir")
    splits_files = {"train": _files(base, basic.get("dataset"), bp + "dataset", source)}
    if basic.get("val_dataset") is not None:
        splits_files["val"] = _files(base, basic["val_dataset"], bp + "val_dataset", source)
    limits = {
        "train": _int(basic, "max_samples", None, bp, source, low=1),
        "val": _int(basic, "val_max_samples", None, bp, source, low=1),
    }
    attr = _attr(attr_section, ap, source)
    try:
        loaded = load_vlm_processor(model_dir)
    except ProcessorLoadError as err:
        raise DataConfigError(f"{source}: `{pp}model_name_or_path`: {err}") from None
    processor = loaded.processor
    if processor.tokenizer.pad_token_id is None:
        raise DataConfigError(f"{source}: `{pp}model_name_or_path`: the tokenizer in {model_dir} has no pad token")
    name = None if chat_template is not None else basic.get("template")
    settings: dict[str, Any] = dict(image_min_pixels=min_pixels, image_max_pixels=max_pixels, cutoff_len=cutoff_len)
    settings.update(flags)
    builder, video_note = _sample_builder(
        processor, name, template, chat_template, settings, (pre, pp, source), model_dir, str(model_type)
    )
    splits: dict[str, Dataset | None] = dict.fromkeys(("train", "val", "test"))
    reports: dict[str, DataReport] = {}
    for split, files in splits_files.items():
        records, report = read_chat_records(
            split, files, attr, root, base, allow_outside_data_root, limits[split], video_note
        )
        reports[split] = report
        strict_or_warn(report, strict, source)
        if not records:
            raise DataError(f"{source}: split '{split}' has no usable record:\n{report.summary()}")
        splits[split] = ChatDataset(records, builder, strict=strict, report=report)
    collate = ChatCollator(
        processor.tokenizer.pad_token_id,
        ignore_pad_token_for_loss=collate_param.get("ignore_pad_token_for_loss") is not False,
        filler=builder.filler(),
        pad_to_multiple_of=collate_param.get("pad_to_multiple_of"),
    )
    return splits, collate, reports
