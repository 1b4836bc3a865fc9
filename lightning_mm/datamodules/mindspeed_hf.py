"""MindSpeed MM's ``dataset_type: huggingface`` (sharegpt records, the model's own processor) as Datasets.

Every key of ``preprocess_parameters``, ``basic_parameters`` and ``attr`` (MindSpeed MM's ``ProcessorArguments``,
``DataArguments`` and ``DatasetAttr``) is honoured, accepted as having no effect here (logged once, with why), or
refused by name (see :data:`_NO_EFFECT` and the ``_refuse_*`` tables); an unknown key suggests the nearest.

Records are checked cheaply up front (JSON, roles and their order, an assistant turn last, ``<image>`` placeholders
against the images, media files present, inside ``dataset_dir`` and readable, text that UTF-8 can encode); only
their text and media paths are kept. Pixels are processed in ``__getitem__``; a record that fails there is counted
in the same report with ``file:line`` and replaced by the next good one, or raises :class:`DataError` in strict mode.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from PIL import Image
from torch.utils.data import Dataset

from lightning_mm._yaml import load_mapping, short_repr
from lightning_mm.datamodules.data_config import DataConfigError
from lightning_mm.datamodules.mindspeed_keys import MAX_FAILURES_IN_A_ROW, check_keys, strict_or_warn
from lightning_mm.datamodules.records import DataError, DataReport, _iter_raw

__all__ = ["build_huggingface_datasets", "ChatRecord", "ChatDataset"]

# key -> (default, what a value other than the default means here: None = honoured)
_PREPROCESS_KEYS = ("model_name_or_path", "use_fast_tokenizer", "split_special_tokens", "image_resolution",
                    "video_resolution", "image_max_pixels", "image_min_pixels", "video_max_pixels", "video_min_pixels",
                    "video_fps", "video_maxlen", "image_do_pan_and_scan", "crop_to_patches", "use_audio_in_video",
                    "audio_sampling_rate", "trust_remote_code", "fix_mistral_regex")
_BASIC_KEYS = ("cache_dir", "template", "enable_thinking", "dataset_dir", "dataset", "cutoff_len", "train_on_prompt",
               "mask_history", "streaming", "overwrite_cache", "preprocessing_batch_size", "preprocessing_num_workers",
               "max_samples", "tool_format", "val_dataset", "val_max_samples", "val_rate", "packing", "neat_packing",
               "preprocess_on_fly", "async_preprocess", "async_preprocess_buffer_size", "use_pmcc_data",
               "chat_template", "stage")
_ATTR_KEYS = ("packing", "ranking", "pretrain", "system", "images", "videos", "audios", "prompt", "query", "response",
              "history", "messages", "role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag",
              "function_tag", "system_tag", "chosen", "rejected", "formatting")
_NO_EFFECT = {
    "cache_dir": "MindSpeed MM caches its offline preprocessing there; here records are processed as they are read",
    "overwrite_cache": "it only controls MindSpeed MM's preprocessing cache; there is none here",
    "preprocessing_batch_size": "it sizes MindSpeed MM's offline preprocessing; here records are processed one "
                                "by one in the loader (its workers are MMDataModule(num_workers=...))",
    "preprocessing_num_workers": "it sizes MindSpeed MM's offline preprocessing; the loader's workers are "
                                 "MMDataModule(num_workers=...)",
    "preprocess_on_fly": "records are always processed on the fly here",
    "async_preprocess_buffer_size": "it only applies to streaming, which is not supported here",
    "video_max_pixels": "videos are not supported here", "video_min_pixels": "videos are not supported here",
    "video_fps": "videos are not supported here", "video_maxlen": "videos are not supported here",
    "audio_sampling_rate": "audio is not supported here",
    "image_resolution": "MindSpeed MM's huggingface dataset does not read it either (images are bounded by "
                        "image_max_pixels/image_min_pixels)",
    "video_resolution": "MindSpeed MM's huggingface dataset does not read it either",
}
# key -> (the only accepted value, why another value is refused)
_FIXED = {
    "use_fast_tokenizer": (True, "the labels are placed with the fast tokenizer's character offsets"),
    "split_special_tokens": (False, "the chat template's special tokens (<|im_start|>, <|image_pad|>, ...) must "
                                    "stay single tokens"),
    "image_do_pan_and_scan": (False, "pan and scan is Gemma 3's, not supported here"),
    "crop_to_patches": (False, "cropping to patches is InternVL's (dataset_type: multimodal)"),
    "use_audio_in_video": (False, "audio is not supported here"),
    "trust_remote_code": (False, "the processor is loaded without remote code here"),
    "fix_mistral_regex": (False, "Mistral models are not supported here"),
    "streaming": (False, "streaming is not supported here: records are read and checked up front"),
    "packing": (None, "packing is not supported here"), "neat_packing": (False, "packing is not supported here"),
    "async_preprocess": (False, "it only applies to streaming, which is not supported here"),
    "use_pmcc_data": (False, "PMCC data is not supported here"),
    "stage": ("sft", "only supervised fine-tuning (stage: sft) is supported here"),
    "tool_format": (None, "tool calling is not supported here"),
    "val_rate": (None, "MindSpeed MM's huggingface dataset does not split by val_rate; give val_dataset"),
    "ranking": (False, "pairwise (ranking) data is not supported here"),
    "pretrain": (False, "pretraining data is not supported here"),
    "audios": (None, "audio is not supported here"),
    "formatting": ("sharegpt", "only sharegpt records are supported here"),
    **{k: (None, "alpaca and pairwise columns are not supported here (formatting: sharegpt)")
       for k in ("prompt", "query", "response", "history", "chosen", "rejected")},
}
_ATTR_DEFAULTS = {"messages": "conversations", "role_tag": "from", "content_tag": "value", "user_tag": "human",
                  "assistant_tag": "gpt", "observation_tag": "observation", "function_tag": "function_call",
                  "system_tag": "system", "system": None, "images": None, "videos": None}


@dataclass(frozen=True)
class ChatRecord:
    """One checked record: where it is, its turns (roles ``user``/``assistant``), system prompt and image paths."""

    file: Path
    line: int
    messages: tuple[tuple[str, str], ...]
    system: str | None
    images: tuple[Path, ...]


@dataclass(frozen=True)
class _Attr:
    messages: str
    role_tag: str
    content_tag: str
    user_tag: str
    assistant_tag: str
    observation_tag: str | None
    function_tag: str | None
    system_tag: str | None
    system: str | None
    images: str | None
    videos: str | None


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


def _int(section: Mapping[str, Any], key: str, default: int | None, prefix: str, source: str, low: int = 0
         ) -> int | None:
    value = section.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DataConfigError(f"{source}: `{prefix}{key}`: expected an integer >= {low}, got {short_repr(value)}")
    return value


def _flag(section: Mapping[str, Any], key: str, default: bool, prefix: str, source: str) -> bool:
    value = section.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise DataConfigError(f"{source}: `{prefix}{key}`: expected true or false, got {short_repr(value)}")
    return value


def _attr(section: Mapping[str, Any], prefix: str, source: str) -> _Attr:
    values = {k: section.get(k, v) for k, v in _ATTR_DEFAULTS.items()}
    for key, value in values.items():
        if value is not None and not isinstance(value, str):
            raise DataConfigError(f"{source}: `{prefix}{key}`: expected a column or tag name, got {short_repr(value)}")
    for key in ("messages", "role_tag", "content_tag", "user_tag", "assistant_tag"):
        if not values[key]:
            raise DataConfigError(f"{source}: `{prefix}{key}`: a name is required")
    return _Attr(**values)


# ----------------------------------------------------------------------------------------------- records
def _turns(raw: dict, attr: _Attr) -> tuple[list[tuple[str, str]], str | None]:
    """MindSpeed MM's sharegpt conversion: a leading system turn, then user/assistant turns alternating."""
    messages = raw.get(attr.messages)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"`{attr.messages}` must be a non-empty list of turns")
    for turn in messages:
        if not isinstance(turn, dict):
            raise ValueError(f"each turn of `{attr.messages}` must be an object, got {type(turn).__name__}")
    system = None
    if attr.system:
        system = raw.get(attr.system)
        if system is not None and not isinstance(system, str):
            raise ValueError(f"`{attr.system}` must be a string")
    if attr.system_tag and messages[0].get(attr.role_tag) == attr.system_tag:
        system = messages[0].get(attr.content_tag)
        if not isinstance(system, str):
            raise ValueError(f"the system turn's `{attr.content_tag}` must be a string")
        messages = messages[1:]
    tools = {t for t in (attr.observation_tag, attr.function_tag) if t}
    turns: list[tuple[str, str]] = []
    for i, turn in enumerate(messages):
        role = turn.get(attr.role_tag)
        if role in tools:
            raise ValueError(f"turn {i + 1}: role {short_repr(role)} (a tool turn) is not supported here")
        expected = (attr.user_tag, "user") if i % 2 == 0 else (attr.assistant_tag, "assistant")
        if role != expected[0]:
            known = {attr.user_tag, attr.assistant_tag, *tools, attr.system_tag}
            what = "unknown role" if role not in known else "role out of order"
            raise ValueError(f"turn {i + 1}: {what} {short_repr(role)} (expected {expected[0]!r}: turns alternate "
                             f"{attr.user_tag!r} and {attr.assistant_tag!r}, {attr.user_tag!r} first)")
        content = turn.get(attr.content_tag)
        if not isinstance(content, str):
            raise ValueError(f"turn {i + 1}: `{attr.content_tag}` must be a string")
        _encodable(content, f"turn {i + 1}")
        turns.append((expected[1], content))
    if not turns or turns[-1][0] != "assistant":
        raise ValueError(f"no {attr.assistant_tag!r} turn ends the conversation")
    if system is not None:
        _encodable(system, "the system prompt")
    return turns, system


def _encodable(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate ("\ud800"): no tokenizer takes it
        raise ValueError(f"{what}: not valid Unicode text ({err.reason} at character {err.start})") from None


def _media(raw: dict, column: str | None) -> list[Any]:
    if not column:
        return []
    value = raw.get(column)
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _image_file(name: Any, root: Path, base: Path, allow_outside: bool) -> Path:
    if not isinstance(name, str) or not name:
        raise ValueError(f"an image must be a path, got {short_repr(name)}")
    inside = (root / name).resolve()
    if inside.is_file() and (allow_outside or inside.is_relative_to(root)):
        path = inside
    elif allow_outside:
        path = (base / name).resolve()
    else:
        why = "lies outside" if not inside.is_relative_to(root) else "is not a file in"
        raise ValueError(f"image {short_repr(name)} {why} dataset_dir {root} (set `allow_outside_data_root: true` "
                         "next to dataset_param to allow paths outside it)")
    if not path.is_file():
        raise ValueError(f"image not found: {path}")
    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as err:  # PIL raises many types for broken files
        raise ValueError(f"cannot read image {path}: {str(err)[:200]}") from None
    return path


def read_chat_records(split: str, files: tuple[Path, ...], attr: _Attr, root: Path, base: Path, allow_outside: bool,
                      max_samples: int | None, video_note: str | None) -> tuple[list[ChatRecord], DataReport]:
    """Check every record (the first ``max_samples`` across the files when given); bad ones go to the report."""
    from lightning_mm.hf.chat_samples import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

    records: list[ChatRecord] = []
    report = DataReport(split)
    for file in files:
        for line, raw, error in _iter_raw(file):
            if max_samples is not None and report.total >= max_samples:
                return records, report
            report.total += 1
            where = f"{file.name}:{line}"
            if error is None and not isinstance(raw, dict):
                error = f"a record must be a JSON object, got {type(raw).__name__}"
            if error is None:
                try:
                    turns, system = _turns(raw, attr)
                    videos = _media(raw, attr.videos)
                    text = "".join(c for _, c in turns)
                    if videos or VIDEO_PLACEHOLDER in text:
                        raise ValueError(f"videos are not supported here ({video_note or 'not implemented'})")
                    images = _media(raw, attr.images)
                    placeholders = sum(c.count(IMAGE_PLACEHOLDER) for r, c in turns if r == "user")
                    if any(IMAGE_PLACEHOLDER in c for r, c in turns if r == "assistant"):
                        raise ValueError(f"an assistant turn holds {IMAGE_PLACEHOLDER}; images go in user turns")
                    if placeholders != len(images):
                        raise ValueError(f"{placeholders} {IMAGE_PLACEHOLDER} placeholders for {len(images)} images")
                    paths = tuple(_image_file(name, root, base, allow_outside) for name in images)
                except ValueError as err:
                    error = str(err)
            if error is not None:
                report.problems.append(f"{where}: {error}")
                continue
            records.append(ChatRecord(file, line, tuple(turns), system, paths))
    return records, report


# ----------------------------------------------------------------------------------------------- dataset
class ChatDataset(Dataset):
    """Checked records, processed in ``__getitem__`` by a :class:`~lightning_mm.hf.chat_samples.ChatSampleBuilder`.

    A record that fails there (an image that does not decode, text the tokenizer rejects, any exception from the
    processor) is counted once in ``report`` with ``file:line`` and warned about, and the next good record (in file
    order, wrapping around) takes its place, so every rank keeps its number of batches; in strict mode it raises
    :class:`DataError`. With ``num_workers > 0`` the count stays in the worker processes (the warning still shows).
    """

    def __init__(self, records: list[ChatRecord], builder: Callable[..., dict], strict: bool = False,
                 report: DataReport | None = None) -> None:
        self.records = records
        self.builder = builder
        self.strict = strict
        self.report = report if report is not None else DataReport("data")
        self.bad: set[int] = set()

    def __len__(self) -> int:
        return len(self.records)

    def sample(self, record: ChatRecord) -> dict[str, Any]:
        images = []
        for path in record.images:
            with Image.open(path) as img:
                images.append(img.convert("RGB"))
        messages = [{"role": role, "content": content} for role, content in record.messages]
        return self.builder(messages, record.system, images)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.records)
        failures = 0
        for step in range(n):
            current = (index + step) % n
            if current in self.bad:
                continue
            record = self.records[current]
            try:
                return self.sample(record)
            except Exception as err:  # any failure of one record's preprocessing is that record's problem
                problem = f"{record.file.name}:{record.line}: cannot process the record: {str(err)[:200]}"
                if self.strict:
                    raise DataError(f"bad record in strict mode: {problem}") from err
                self.bad.add(current)
                self.report.problems.append(f"{problem} (at load time; the next good record is used in its place)")
                warnings.warn(f"data: skipped {problem}; the next good record is used in its place", stacklevel=2)
                failures += 1
                if failures >= MAX_FAILURES_IN_A_ROW:
                    raise DataError(f"{self.report.split}: {failures} records in a row failed to process (the last "
                                    f"at {record.file.name}:{record.line}); the data or the processor is broken"
                                    ) from err
        raise DataError(f"{self.report.split}: no record could be processed ({len(self.bad)} failed)")


# ----------------------------------------------------------------------------------------------- builder
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
    from lightning_mm.hf.chat_samples import ChatSampleBuilder, template_for
    from lightning_mm.hf.vlm_processor import ProcessorLoadError, load_vlm_processor

    dp = prefix + "dataset_param."
    base = Path(base_dir).resolve()
    pre = check_keys(dataset_param.get("preprocess_parameters"), _PREPROCESS_KEYS, dp + "preprocess_parameters.",
                     source)
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
    chat_template = None
    if basic.get("chat_template") is not None:  # MindSpeed MM's FSDP trainer: a file, before `template`
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
            rank_zero_info(f"{source}: `{bp}template` is not used: `{bp}chat_template` {chat_file} renders the "
                           "conversations (as in MindSpeed MM)")
    try:
        template = template_for(None if chat_template is not None else basic.get("template"), model_type)
    except ValueError as err:
        raise DataConfigError(f"{source}: `{bp}template`: {err}") from None
    for key in ("model_name", "collator_id"):
        name = collate_param.get(key)
        if name is not None and name not in template.collate_names:
            raise DataConfigError(f"{source}: `{prefix}dataloader_param.collate_param.{key}`: {short_repr(name)} "
                                  f"does not fit a {model_type} model (expected {' or '.join(template.collate_names)})")
    cutoff_len = _int(basic, "cutoff_len", None, bp, source, low=1)
    min_pixels = _int(pre, "image_min_pixels", 32 * 32, pp, source)
    max_pixels = _int(pre, "image_max_pixels", 768 * 768, pp, source, low=1)
    if min_pixels is None or max_pixels is None or min_pixels > max_pixels:
        raise DataConfigError(f"{source}: `{pp}image_min_pixels`: {min_pixels} must be at most image_max_pixels "
                              f"{max_pixels}")
    flags = {k: _flag(basic, k, d, bp, source) for k, d in
             (("train_on_prompt", False), ("mask_history", False), ("enable_thinking", True))}
    root = _path(base, basic.get("dataset_dir", "data"), bp + "dataset_dir", source, "dir")
    splits_files = {"train": _files(base, basic.get("dataset"), bp + "dataset", source)}
    if basic.get("val_dataset") is not None:
        splits_files["val"] = _files(base, basic["val_dataset"], bp + "val_dataset", source)
    limits = {"train": _int(basic, "max_samples", None, bp, source, low=1),
              "val": _int(basic, "val_max_samples", None, bp, source, low=1)}
    attr = _attr(attr_section, ap, source)
    try:
        loaded = load_vlm_processor(model_dir)
    except ProcessorLoadError as err:
        raise DataConfigError(f"{source}: `{pp}model_name_or_path`: {err}") from None
    processor = loaded.processor
    if processor.tokenizer.pad_token_id is None:
        raise DataConfigError(f"{source}: `{pp}model_name_or_path`: the tokenizer in {model_dir} has no pad token")
    builder = ChatSampleBuilder(processor, template, image_min_pixels=min_pixels, image_max_pixels=max_pixels,
                                cutoff_len=cutoff_len, chat_template=chat_template, **flags)
    splits: dict[str, Dataset | None] = dict.fromkeys(("train", "val", "test"))
    reports: dict[str, DataReport] = {}
    for split, files in splits_files.items():
        records, report = read_chat_records(split, files, attr, root, base, allow_outside_data_root, limits[split],
                                            loaded.video_note)
        reports[split] = report
        strict_or_warn(report, strict, source)
        if not records:
            raise DataError(f"{source}: split '{split}' has no usable record:\n{report.summary()}")
        splits[split] = ChatDataset(records, builder, strict=strict, report=report)
    collate = ChatCollator(processor.tokenizer.pad_token_id,
                           ignore_pad_token_for_loss=collate_param.get("ignore_pad_token_for_loss") is not False,
                           filler=builder.filler(), pad_to_multiple_of=collate_param.get("pad_to_multiple_of"))
    return splits, collate, reports
