"""MindSpeed MM's ``dataset_type: multimodal`` (InternVL) data configs, built with InternVL's own HF processor.

Entry point: :func:`build_multimodal_datasets` (``dataset_param`` and ``dataloader_param.collate_param`` of a
MindSpeed MM ``data.json``). Records are LLaVA style (``{"image": "a.jpg", "conversations": [{"from": "human",
"value": "<image>\\n..."}, {"from": "gpt", "value": "..."}]}``, JSON lines or a JSON list), with image paths
relative to ``data_folder``; ``image`` may be a list (several images, as many ``<image>`` placeholders).

Every key is honoured or refused by name. The settings map onto InternVL's processor (Transformers'
``InternVLProcessor`` with ``GotOcr2ImageProcessor``): ``dynamic_image_size`` -> ``crop_to_patches``,
``min_dynamic_patch``/``max_dynamic_patch`` -> ``min_patches``/``max_patches`` (``max_dynamic_patch // n`` per
image for a record of ``n`` images, as MindSpeed MM), and the rest is checked against the processor and the model
config (``image_size``, ``patch_size``, ``down_sample_ratio``, the image tokens per tile, the normalisation of
``train_pipeline``, the resampling filter), so that a sample is what MindSpeed MM's ``MultiModalChatDataset``
computes: the same tiles (PIL tiling with a thumbnail, ``Pad2Square`` without tiling), the ``internvl2_5`` text
and labels on the assistant turns only (:mod:`lightning_mm.hf.internvl_conversation`).

Differences from MindSpeed MM, on purpose: bad records are counted with ``file:line`` up front (or a
:class:`DataError` in strict mode) instead of being retried with a random other record at load time; sequences are
not cut at ``--seq-length`` (a training argument, not part of the data config) and the collate pads to the longest
sample of the batch (MindSpeed pads to ``--seq-length`` without ``group_by_length``: the loss is the same); the
attention mask comes from the lengths, not from ``input_ids != pad_id``; a record whose first turn is a system turn
gets no ``<image>`` prepended to that system text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import ConcatDataset, Dataset

from lightning_mm._utils.suggestions import find_unknown_key
from lightning_mm._utils.yaml_io import short_repr
from lightning_mm.data.data_config import DataConfigError
from lightning_mm.data.record_files import DataError, DataReport, iter_raw_records
from lightning_mm.data.replacing import ReplacingDataset
from lightning_mm.hf.internvl_conversation import (
    IGNORE_INDEX,
    IMAGE_PLACEHOLDER,
    TEMPLATES,
    ConversationTemplate,
    assistant_labels,
    conversation_text,
)
from lightning_mm.mindspeed.keys import KeyReader

__all__ = ["build_multimodal_datasets", "MultimodalSettings", "InternVLChatDataset", "InternVLCollator"]

# ------------------------------------------------------------------------------------------------ the keys
_TOP_KEYS = (
    "dataset_type",
    "basic_parameters",
    "preprocess_parameters",
    "tokenizer_config",
    "use_text_processer",
    "template_name",
    "patch_size",
    "image_size",
    "down_sample_ratio",
    "group_by_length",
    "dynamic_image_size",
    "use_thumbnail",
    "min_dynamic_patch",
    "max_dynamic_patch",
    "min_num_frame",
    "max_num_frame",
    "sampling_method",
    "is_multimodal",
    "mm_use_im_start_end",
)
_BASIC_KEYS = ("data_path", "data_folder", "repeat_time", "data_storage_mode")
_PREPROCESS_KEYS = ("image_reader_type", "train_pipeline")
_TOKENIZER_KEYS = ("hub_backend", "autotokenizer_name", "from_pretrained", "add_eos_token", "use_fast")
_COLLATE_KEYS = ("model_name", "pad_id")
_STEP_KEYS = ("trans_type", "param")
_IMAGE_READERS = ("torchvision", "CLIPImageProcessor", "Image")  # all three: PIL open + convert("RGB")
# MindSpeed MM's image transforms (IMAGE_TRANSFORM_MAPPING); the first four are reproduced.
_SUPPORTED_STEPS = ("Pad2Square", "Resize", "ToTensor", "norm_fun")
_OTHER_STEPS = (
    "Lambda",
    "ToTensorVideo",
    "CenterCropResizeVideo",
    "CenterCropArr",
    "ResizeCropToFill",
    "RandomHorizontalFlip",
    "ae_norm",
    "DataAugment",
    "ResizeToFill",
)
_STEP_PARAMS = {
    "Pad2Square": ("mean",),
    "Resize": ("size", "interpolation", "antialias", "max_size"),
    "ToTensor": (),
    "norm_fun": ("mean", "std", "inplace"),
}
# torchvision's InterpolationMode names (MindSpeed's INTERPOLATIONMODE_MAPPING) as PIL filters.
_PIL_FILTERS = {"NEAREST": 0, "LANCZOS": 1, "BILINEAR": 2, "BICUBIC": 3, "BOX": 4, "HAMMING": 5}
_BICUBIC = 3
_DEFAULTS = {  # MultiModalChatDataset's defaults
    "image_size": 224,
    "patch_size": 14,
    "down_sample_ratio": 0.5,
    "group_by_length": False,
    "dynamic_image_size": False,
    "use_thumbnail": False,
    "min_dynamic_patch": 1,
    "max_dynamic_patch": 6,
    "min_num_frame": 4,
    "max_num_frame": 12,
    "sampling_method": "rand",
    "use_text_processer": False,
    "is_multimodal": True,
    "mm_use_im_start_end": True,
}
_VIDEO_REFUSED = (
    "video records are not supported: Transformers' InternVL video processor needs torchvision, "
    "which this installation does not load"
)


@dataclass(frozen=True)
class DataSource:
    """One ``basic_parameters`` entry."""

    data_path: Path
    data_folder: Path
    repeat_time: float


@dataclass(frozen=True)
class MultimodalSettings:
    """A validated ``dataset_param`` + ``collate_param``; paths are absolute."""

    sources: tuple[DataSource, ...]
    model_dir: Path
    template: ConversationTemplate
    image_size: int
    patch_size: int
    down_sample_ratio: float
    dynamic_image_size: bool
    use_thumbnail: bool
    min_dynamic_patch: int
    max_dynamic_patch: int
    pad_square_color: tuple[int, int, int] | None  # Pad2Square's background, applied when not tiling
    resize_filter: int | None  # Resize's PIL filter (None: no Resize step)
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None  # norm_fun's (mean, std)
    pad_id: int
    source: str

    @property
    def image_tokens_per_tile(self) -> int:
        """MindSpeed MM's ``num_image_token``."""
        return int((self.image_size // self.patch_size) ** 2 * (self.down_sample_ratio**2))


class _Fail(KeyReader):
    """The key reader of a multimodal data config: ``fail(key, message)`` is ``DataConfigError('<source>: `key`:
    message')``."""

    def __init__(self, source: str) -> None:
        super().__init__(source, error=DataConfigError)

    def __call__(self, key: str, message: str) -> Exception:
        return self.fail(key, message)

    def refuse_unknown(self, data: Mapping[str, Any], known: Sequence[str], prefix: str) -> None:
        unknown = KeyReader(self.source, prefix).unknown(data, known)
        if unknown is not None:
            shown, hint = unknown
            raise DataConfigError(f"{self.source}: unknown key `{shown}`{hint}")

    def mapping(self, value: Any, key: str) -> dict[str, Any]:
        return dict(super().mapping(value, key))


def _bool(data: Mapping[str, Any], key: str, fail: _Fail, prefix: str = "") -> bool:
    return fail.flag(data.get(key, _DEFAULTS.get(key, False)), prefix + key)


def _positive_int(data: Mapping[str, Any], key: str, fail: _Fail, prefix: str = "") -> int:
    value = data.get(key, _DEFAULTS.get(key))
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise fail(prefix + key, f"expected a positive integer, got {short_repr(value)}")
    return value


def _numbers(value: Any, key: str, fail: _Fail) -> tuple[float, float, float]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 3
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
    ):
        raise fail(key, f"expected three finite numbers, got {short_repr(value)}")
    return float(value[0]), float(value[1]), float(value[2])


# ------------------------------------------------------------------------------------------------ parsing
def parse_settings(
    dataset_param: Mapping[str, Any], collate_param: Mapping[str, Any], base_dir: Path, source: str
) -> MultimodalSettings:
    """Check every key of ``dataset_param`` and ``collate_param`` (no file is read but the paths' existence)."""
    fail = _Fail(source)
    data = fail.mapping(dataset_param, "dataset_param")
    if "repeat_time" in data:
        raise fail(
            "dataset_param.repeat_time",
            "set it in `basic_parameters` (MindSpeed MM replaces the top-level "
            "value with that of each basic_parameters entry)",
        )
    fail.refuse_unknown(data, _TOP_KEYS, "dataset_param.")
    if data.get("dataset_type", "multimodal") != "multimodal":
        raise fail("dataset_param.dataset_type", f"expected 'multimodal', got {short_repr(data['dataset_type'])}")
    base = Path(base_dir).resolve()
    for key in ("basic_parameters", "preprocess_parameters", "tokenizer_config"):
        if key not in data:
            raise fail(f"dataset_param.{key}", "missing (MindSpeed MM's multimodal dataset needs it)")
    sources = _parse_sources(data["basic_parameters"], base, fail)
    for key in ("use_text_processer", "group_by_length", "is_multimodal", "mm_use_im_start_end"):
        _bool(data, key, fail, "dataset_param.")  # no effect on MindSpeed MM's internvl2_5 samples either
    template = _parse_template(data, fail)
    image_size = _positive_int(data, "image_size", fail, "dataset_param.")
    patch_size = _positive_int(data, "patch_size", fail, "dataset_param.")
    ratio = data.get("down_sample_ratio", _DEFAULTS["down_sample_ratio"])
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise fail("dataset_param.down_sample_ratio", f"expected a number in (0, 1], got {short_repr(ratio)}")
    dynamic = _bool(data, "dynamic_image_size", fail, "dataset_param.")
    thumbnail = _bool(data, "use_thumbnail", fail, "dataset_param.")
    low = _positive_int(data, "min_dynamic_patch", fail, "dataset_param.")
    high = _positive_int(data, "max_dynamic_patch", fail, "dataset_param.")
    if low > high:
        raise fail("dataset_param.min_dynamic_patch", f"{low} is larger than max_dynamic_patch {high}")
    if dynamic and high > 1 and not thumbnail:
        raise fail(
            "dataset_param.use_thumbnail",
            "false is not supported with dynamic_image_size: InternVL's "
            "processor always adds the thumbnail tile to a tiled image",
        )
    _parse_video_keys(data, fail)
    pad_color, resize_filter, normalize = _parse_pipeline(data["preprocess_parameters"], image_size, dynamic, fail)
    model_dir = _parse_tokenizer_config(data["tokenizer_config"], base, fail)
    pad_id = _parse_collate(collate_param, fail)
    return MultimodalSettings(
        sources,
        model_dir,
        template,
        image_size,
        patch_size,
        float(ratio),
        dynamic,
        thumbnail,
        low,
        high,
        pad_color,
        resize_filter,
        normalize,
        pad_id,
        source,
    )


def _parse_sources(value: Any, base: Path, fail: _Fail) -> tuple[DataSource, ...]:
    entries = value if isinstance(value, list) else [value]
    if not entries:
        raise fail("dataset_param.basic_parameters", "an empty list")
    sources = []
    for i, entry in enumerate(entries):
        prefix = "dataset_param.basic_parameters." + (f"{i}." if isinstance(value, list) else "")
        entry = fail.mapping(entry, prefix.rstrip("."))
        if "val_rate" in entry:
            raise fail(
                prefix + "val_rate",
                "MindSpeed MM splits off validation data only for dataset_type 'huggingface', not for 'multimodal'",
            )
        fail.refuse_unknown(entry, _BASIC_KEYS, prefix)
        if entry.get("data_storage_mode", "standard") != "standard":
            mode = short_repr(entry["data_storage_mode"])
            raise fail(prefix + "data_storage_mode", f"only 'standard' is used by the multimodal dataset, got {mode}")
        path = entry.get("data_path")
        if not isinstance(path, str) or not path:
            raise fail(prefix + "data_path", f"expected a file name, got {short_repr(path)}")
        file = (base / path).resolve()
        if file.suffix not in (".json", ".jsonl"):
            raise fail(prefix + "data_path", f"{short_repr(path)}: only .json (a list) and .jsonl files are read")
        if not file.is_file():
            raise fail(prefix + "data_path", f"file not found: {file}")
        folder_name = entry.get("data_folder", "")
        if not isinstance(folder_name, str):
            raise fail(prefix + "data_folder", f"expected a directory name, got {short_repr(folder_name)}")
        folder = (base / folder_name).resolve()
        if not folder.is_dir():
            raise fail(prefix + "data_folder", f"directory not found: {folder}")
        repeat = entry.get("repeat_time", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or not math.isfinite(repeat) or repeat <= 0:
            raise fail(prefix + "repeat_time", f"expected a positive number, got {short_repr(repeat)}")
        if repeat > 1 and repeat != int(repeat):
            raise fail(
                prefix + "repeat_time",
                f"above 1 it must be a whole number (MindSpeed MM repeats the list "
                f"of records), got {short_repr(repeat)}",
            )
        sources.append(DataSource(file, folder, float(repeat)))
    return tuple(sources)


def _parse_template(data: Mapping[str, Any], fail: _Fail) -> ConversationTemplate:
    name = data.get("template_name")
    if name == "internvit_qwen3":
        raise fail(
            "dataset_param.template_name",
            "'internvit_qwen3' writes Qwen's vision tokens "
            "(<|vision_start|>, <|image_pad|>), which InternVL's processor does "
            "not; use 'internvl2_5'",
        )
    if name not in TEMPLATES:
        unknown = find_unknown_key([name], list(TEMPLATES))
        hint = unknown[1] if unknown else ""
        raise fail("dataset_param.template_name", f"unknown template {short_repr(name)}{hint}")
    return TEMPLATES[name]


def _parse_video_keys(data: Mapping[str, Any], fail: _Fail) -> None:
    low = _positive_int(data, "min_num_frame", fail, "dataset_param.")
    high = _positive_int(data, "max_num_frame", fail, "dataset_param.")
    if low > high:
        raise fail("dataset_param.min_num_frame", f"{low} is larger than max_num_frame {high}")
    method = data.get("sampling_method", "rand")
    ok = method in ("rand", "middle")
    if isinstance(method, str) and method.startswith("fps"):
        try:
            ok = float(method[3:]) > 0
        except ValueError:
            ok = False
    if not ok:
        raise fail(
            "dataset_param.sampling_method",
            f"expected 'rand', 'middle' or 'fps<frames per second>', got {short_repr(method)}",
        )


def _parse_pipeline(
    value: Any, image_size: int, dynamic: bool, fail: _Fail
) -> tuple[tuple[int, int, int] | None, int | None, tuple[tuple[float, ...], tuple[float, ...]] | None]:
    """(Pad2Square colour or None, Resize filter or None, (mean, std) or None) of ``train_pipeline.image``."""
    pre = fail.mapping(value, "dataset_param.preprocess_parameters")
    fail.refuse_unknown(pre, _PREPROCESS_KEYS, "dataset_param.preprocess_parameters.")
    reader = pre.get("image_reader_type", "torchvision")
    if reader not in _IMAGE_READERS:
        raise fail(
            "dataset_param.preprocess_parameters.image_reader_type",
            f"expected one of {', '.join(_IMAGE_READERS)}, got {short_repr(reader)}",
        )
    where = "dataset_param.preprocess_parameters.train_pipeline"
    if "train_pipeline" not in pre:
        raise fail(where, "missing (MindSpeed MM transforms every tile with it)")
    pipeline = fail.mapping(pre["train_pipeline"], where)
    if "video" in pipeline:
        raise fail(
            where + ".video",
            "not used by MindSpeed MM's multimodal dataset (video frames go through the image pipeline)",
        )
    fail.refuse_unknown(pipeline, ("image",), where + ".")
    steps = pipeline.get("image")
    if not isinstance(steps, list):
        raise fail(where + ".image", f"expected a list of transforms, got {short_repr(steps)}")
    order = {name: i for i, name in enumerate(_SUPPORTED_STEPS)}
    seen: list[str] = []
    pad_color: tuple[int, int, int] | None = None
    resize_filter: int | None = None
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    for i, step in enumerate(steps):
        key = f"{where}.image.{i}"
        step = fail.mapping(step, key)
        fail.refuse_unknown(step, _STEP_KEYS, key + ".")
        kind = step.get("trans_type")
        if kind in _OTHER_STEPS:
            raise fail(
                key + ".trans_type",
                f"{kind} is not reproduced by InternVL's processor (supported: {', '.join(_SUPPORTED_STEPS)})",
            )
        if kind not in _SUPPORTED_STEPS:
            hint = (find_unknown_key([kind], [*_SUPPORTED_STEPS, *_OTHER_STEPS]) or ("", ""))[1]
            raise fail(key + ".trans_type", f"unknown transform {short_repr(kind)}{hint}")
        if kind in seen or (seen and order[seen[-1]] > order[kind]):
            raise fail(
                key + ".trans_type",
                f"{kind} after {', '.join(seen)}: the order must be {', '.join(_SUPPORTED_STEPS)} (each at most once)",
            )
        seen.append(kind)
        param = fail.mapping(step.get("param") or {}, key + ".param")
        fail.refuse_unknown(param, _STEP_PARAMS[kind], key + ".param.")
        if kind == "Pad2Square":
            mean = _numbers(param.get("mean"), key + ".param.mean", fail)
            if not all(0 <= x <= 1 for x in mean):
                raise fail(key + ".param.mean", f"expected values in [0, 1], got {short_repr(param.get('mean'))}")
            pad_color = (int(mean[0] * 255), int(mean[1] * 255), int(mean[2] * 255))
        elif kind == "Resize":
            resize_filter = _parse_resize(param, image_size, dynamic, pad_color is not None, key, fail)
        elif kind == "norm_fun":
            mean = _numbers(param.get("mean"), key + ".param.mean", fail)
            std = _numbers(param.get("std"), key + ".param.std", fail)
            if any(s == 0 for s in std):
                raise fail(key + ".param.std", "a standard deviation of 0 makes every pixel NaN or infinite")
            if not isinstance(param.get("inplace", False), bool):
                raise fail(key + ".param.inplace", f"expected true or false, got {short_repr(param['inplace'])}")
            normalize = (mean, std)
    if "ToTensor" not in seen:
        raise fail(where + ".image", "needs a ToTensor step (MindSpeed MM stacks tensors)")
    if not dynamic and "Resize" not in seen:
        raise fail(
            where + ".image",
            f"needs a Resize to [{image_size}, {image_size}] without dynamic_image_size "
            "(every image must become one tile)",
        )
    return pad_color, resize_filter, normalize


def _parse_resize(param: Mapping[str, Any], image_size: int, dynamic: bool, padded: bool, key: str, fail: _Fail) -> int:
    size = param.get("size")
    square = isinstance(size, list) and len(size) == 2 and size == [image_size, image_size]
    if not (square or size == image_size) or isinstance(size, bool):
        raise fail(
            key + ".param.size",
            f"expected [{image_size}, {image_size}] (image_size), got {short_repr(size)}: "
            "InternVL's processor makes tiles of image_size",
        )
    if isinstance(size, int) and not dynamic and not padded:
        raise fail(
            key + ".param.size",
            f"{size} resizes the shorter side only; without dynamic_image_size or "
            f"Pad2Square use [{image_size}, {image_size}]",
        )
    if param.get("max_size") is not None:
        raise fail(key + ".param.max_size", "not supported (tiles are image_size squares)")
    if param.get("antialias", None) not in (None, True, False):
        raise fail(key + ".param.antialias", f"expected true, false or null, got {short_repr(param['antialias'])}")
    name = param.get("interpolation", "BILINEAR")  # torchvision's default
    if name not in _PIL_FILTERS:
        raise fail(
            key + ".param.interpolation",
            f"expected one of {', '.join(_PIL_FILTERS)} (PIL's filters), got {short_repr(name)}",
        )
    return _PIL_FILTERS[name]


def _parse_tokenizer_config(value: Any, base: Path, fail: _Fail) -> Path:
    where = "dataset_param.tokenizer_config"
    config = fail.mapping(value, where)
    fail.refuse_unknown(config, _TOKENIZER_KEYS, where + ".")
    if config.get("hub_backend", "hf") != "hf":
        raise fail(
            where + ".hub_backend", f"only 'hf' (Hugging Face) is supported, got {short_repr(config['hub_backend'])}"
        )
    if config.get("autotokenizer_name", "AutoTokenizer") not in ("AutoTokenizer", "AutoProcessor"):
        raise fail(
            where + ".autotokenizer_name",
            "expected 'AutoTokenizer': the tokenizer is the one of InternVL's "
            f"processor, got {short_repr(config['autotokenizer_name'])}",
        )
    if config.get("add_eos_token", False) is not False:
        raise fail(
            where + ".add_eos_token",
            "only false: MindSpeed MM tokenizes each turn on its own, so an EOS "
            "token would end every turn; turns end with <|im_end|>",
        )
    if not isinstance(config.get("use_fast", True), bool):
        raise fail(where + ".use_fast", f"expected true or false, got {short_repr(config['use_fast'])}")
    name = config.get("from_pretrained")
    if not isinstance(name, str) or not name:
        raise fail(where + ".from_pretrained", f"expected the local model directory, got {short_repr(name)}")
    directory = (base / name).resolve()
    if not directory.is_dir():
        raise fail(where + ".from_pretrained", f"directory not found: {directory}")
    return directory


def _parse_collate(value: Any, fail: _Fail) -> int:
    where = "dataloader_param.collate_param"
    param = fail.mapping(value, where)
    fail.refuse_unknown(param, _COLLATE_KEYS, where + ".")
    if param.get("model_name") != "internvl":
        raise fail(
            where + ".model_name",
            f"expected 'internvl' for dataset_type multimodal, got {short_repr(param.get('model_name'))}",
        )
    pad_id = param.get("pad_id")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise fail(where + ".pad_id", f"expected a token id (a non-negative integer), got {short_repr(pad_id)}")
    return pad_id


# ------------------------------------------------------------------------------------------------ the processor
def check_processor(settings: MultimodalSettings, processor: Any, model_config: Any) -> int:
    """Refuse settings the processor or the model would not follow; returns the assistant header's token count."""
    fail = _Fail(settings.source)
    pre = "dataset_param."
    image = processor.image_processor
    tokenizer = processor.tokenizer
    vision = model_config.vision_config
    size = getattr(image, "size", None) or {}
    height, width = (
        (size.get("height"), size.get("width"))
        if isinstance(size, Mapping)
        else (getattr(size, "height", None), getattr(size, "width", None))
    )
    if (height, width) != (settings.image_size, settings.image_size):
        raise fail(pre + "image_size", f"{settings.image_size}, but the image processor makes {height}x{width} tiles")
    if tuple(vision.image_size) != (settings.image_size, settings.image_size):
        raise fail(
            pre + "image_size",
            f"{settings.image_size}, but the model's vision_config.image_size is {list(vision.image_size)}",
        )
    if tuple(vision.patch_size) != (settings.patch_size, settings.patch_size):
        raise fail(
            pre + "patch_size",
            f"{settings.patch_size}, but the model's vision_config.patch_size is {list(vision.patch_size)}",
        )
    if not math.isclose(settings.down_sample_ratio, model_config.downsample_ratio, abs_tol=1e-9):
        raise fail(
            pre + "down_sample_ratio",
            f"{settings.down_sample_ratio}, but the model's downsample_ratio is {model_config.downsample_ratio}",
        )
    side = (settings.image_size // settings.patch_size) * settings.down_sample_ratio
    model_tokens = int(side * side)
    if not (settings.image_tokens_per_tile == model_tokens == processor.image_seq_length):
        raise fail(
            pre + "down_sample_ratio",
            f"image tokens per tile: {settings.image_tokens_per_tile} from image_size, patch_size and "
            f"down_sample_ratio, {model_tokens} in the model, {processor.image_seq_length} in the processor "
            "(image_seq_length)",
        )
    if model_config.image_token_id != processor.image_token_id:
        raise fail(
            pre + "tokenizer_config.from_pretrained",
            f"the model's image_token_id {model_config.image_token_id} is not the tokenizer's "
            f"{processor.image_token!r} ({processor.image_token_id})",
        )
    vocab = model_config.text_config.vocab_size
    if settings.pad_id >= vocab:
        raise fail(
            "dataloader_param.collate_param.pad_id", f"{settings.pad_id} is not below the vocabulary size {vocab}"
        )
    _check_normalisation(settings, image, fail)
    template = settings.template
    for key, mine, theirs in (
        ("image_start", template.image_start, processor.start_image_token),
        ("image_context", template.image_context, processor.image_token),
        ("image_end", template.image_end, processor.end_image_token),
    ):
        if mine != theirs:
            raise fail(pre + "template_name", f"{template.name} writes {mine!r} ({key}), the processor {theirs!r}")
    for token in (template.turn_start, template.turn_end):
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise fail(
                pre + "tokenizer_config.from_pretrained",
                f"{template.name} needs {token!r} as one special token; the tokenizer splits it into {len(ids)}",
            )
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    if full[len(full) - len(plain) :] != plain:
        raise fail(
            pre + "tokenizer_config.from_pretrained",
            "the tokenizer appends special tokens to every text; MindSpeed MM would append them to every turn",
        )
    return len(tokenizer(template.assistant_header, add_special_tokens=False)["input_ids"])


def _check_normalisation(settings: MultimodalSettings, image: Any, fail: _Fail) -> None:
    where = "dataset_param.preprocess_parameters.train_pipeline.image"
    if not image.do_rescale or not math.isclose(image.rescale_factor, 1 / 255, rel_tol=1e-9):
        raise fail(
            where,
            f"ToTensor scales by 1/255; the image processor rescales by "
            f"{image.rescale_factor if image.do_rescale else 'nothing'}",
        )
    if settings.normalize is None:
        if image.do_normalize:
            raise fail(where, "has no norm_fun, but the image processor normalises")
    else:
        if not image.do_normalize:
            raise fail(where, "norm_fun normalises, but the image processor does not (do_normalize: false)")
        for name, mine, theirs in (
            ("mean", settings.normalize[0], image.image_mean),
            ("std", settings.normalize[1], image.image_std),
        ):
            theirs = list(theirs) if isinstance(theirs, (list, tuple)) else [theirs] * 3
            if not all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(mine, theirs)):
                raise fail(
                    f"{where}.norm_fun.{name}", f"{list(mine)}, but the image processor's image_{name} is {theirs}"
                )
    wanted = _BICUBIC if settings.dynamic_image_size else settings.resize_filter
    resample = int(image.resample) if image.resample is not None else None
    if resample != wanted:
        names: dict[int | None, str] = {v: k for k, v in _PIL_FILTERS.items()}
        why = (
            "MindSpeed MM tiles with PIL's default filter, BICUBIC"
            if settings.dynamic_image_size
            else "Resize's interpolation"
        )
        raise fail(where, f"{why}; the image processor resamples with {names.get(resample, resample)}")
    if not settings.dynamic_image_size and not image.do_resize:
        raise fail(where, "Resize makes one tile of every image, but the image processor does not resize")


# ------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class ChatRecord:
    """One checked record."""

    file: Path
    line: int
    images: tuple[Path, ...]
    turns: tuple[tuple[str, str], ...]

    @property
    def where(self) -> str:
        return f"{self.file.name}:{self.line}"


def _special_tokens(template: ConversationTemplate, processor: Any) -> tuple[str, ...]:
    return tuple(
        dict.fromkeys(
            (
                template.turn_start,
                template.turn_end,
                template.image_start,
                template.image_context,
                template.image_end,
                processor.image_token,
                processor.video_token,
            )
        )
    )


def _check_record(raw: Any, folder: Path, specials: tuple[str, ...]) -> tuple[tuple[Path, ...], list] | str:
    """(images, turns) of a good record, or why it is bad."""
    if not isinstance(raw, dict):
        return f"a record must be a JSON object, got {type(raw).__name__}"
    image = raw.get("image")
    video = raw.get("video")
    if video not in (None, "") and image not in (None, "", []):
        return "a record has either `image` or `video`, not both"
    if image in (None, "", []):
        return _VIDEO_REFUSED if video not in (None, "") else "no `image` (the multimodal dataset trains image records)"
    names = image if isinstance(image, list) else [image]
    if not all(isinstance(n, str) and n for n in names):
        return f"`image` must be a file name or a list of file names, got {short_repr(image)}"
    turns = raw.get("conversations")
    if not isinstance(turns, list) or not turns:
        return "`conversations` must be a non-empty list"
    pairs = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return f"conversation turn {i} needs a string `value`"
        role = turn.get("from")
        if role not in ("system", "human", "gpt") or (role == "system" and i > 0):
            return (
                f"conversation turn {i}: role {short_repr(role)} (expected human or gpt, and system only as the "
                "first turn)"
            )
        value = turn["value"]
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return f"conversation turn {i}: text the tokenizer cannot encode ({err.reason} at character {err.start})"
        for token in specials:
            if token in value:
                return f"conversation turn {i}: the text holds the special token {token!r}"
        if IMAGE_PLACEHOLDER in value and role != "human":
            return f"conversation turn {i}: {IMAGE_PLACEHOLDER} in a {role} turn (only human turns hold images)"
        pairs.append((role, value))
    if not any(role == "gpt" for role, _ in pairs):
        return "no gpt turn: nothing to train on"
    placeholders = sum(value.count(IMAGE_PLACEHOLDER) for _, value in pairs)
    if placeholders == 0 and isinstance(image, str) and pairs[0][0] == "human":
        pairs[0] = ("human", f"{IMAGE_PLACEHOLDER}\n{pairs[0][1]}")  # as MindSpeed MM does
        placeholders = 1
    if placeholders != len(names):
        return f"{placeholders} {IMAGE_PLACEHOLDER} placeholders for {len(names)} images"
    paths = []
    for name in names:
        path, problem = _image_file(folder, name)
        if problem is not None:
            return problem
        paths.append(path)
    return tuple(paths), pairs


def _image_file(folder: Path, name: str) -> tuple[Path, str | None]:
    try:
        path = (folder / name).resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte
        return folder, f"bad image path {short_repr(name)}: {err}"
    if not path.is_relative_to(folder):
        return path, f"image path {short_repr(name)} lies outside data_folder {folder}"
    if not path.is_file():
        return path, f"image not found: {path}"
    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as err:  # PIL raises many types for broken files
        return path, f"cannot read image {path}: {err}"
    return path, None


def read_chat_records(source: DataSource, specials: tuple[str, ...], report: DataReport) -> list[ChatRecord]:
    """The good records of one source, in file order, after ``repeat_time`` below 1 (bad ones go to ``report``)."""
    raw = list(iter_raw_records(source.data_path))
    if source.repeat_time < 1:  # MindSpeed MM keeps the first int(n * repeat_time) records of the file
        raw = raw[: int(len(raw) * source.repeat_time)]
    records = []
    for line, item, error in raw:
        report.total += 1
        where = f"{source.data_path.name}:{line}"
        checked = error if error is not None else _check_record(item, source.data_folder, specials)
        if isinstance(checked, str):
            report.problems.append(f"{where}: {checked}")
            continue
        images, turns = checked
        records.append(ChatRecord(source.data_path, line, images, tuple(turns)))
    return records


# ------------------------------------------------------------------------------------------------ dataset
class InternVLChatDataset(ReplacingDataset):
    """Checked records as InternVL samples: ``input_ids``, ``labels`` and ``pixel_values`` (all tiles).

    The images are read and tiled, and the text tokenized, in ``__getitem__`` (one record at a time). A record
    that fails there (an image that does not decode, text the tokenizer rejects) is counted in ``report`` with its
    ``file:line`` and warned about, and the next good record (in file order, wrapping around) takes its place, so
    that the dataset keeps its length on every rank; :data:`MAX_FAILURES_IN_A_ROW` failures for one sample, or any
    failure in strict mode, are a :class:`DataError`.
    """

    def __init__(
        self,
        records: list[ChatRecord],
        repeat: int,
        processor: Any,
        settings: MultimodalSettings,
        header_length: int,
        report: DataReport,
        strict: bool = False,
    ) -> None:
        super().__init__(records, report, strict)
        self.repeat = repeat
        self.processor = processor
        self.settings = settings
        self.header_length = header_length
        self.turn_start_id = processor.tokenizer.convert_tokens_to_ids(settings.template.turn_start)

    def _image(self, path: Path) -> Image.Image:
        with open(path, "rb") as handle:  # as torchvision's pil_loader
            img = Image.open(handle).convert("RGB")
        color = self.settings.pad_square_color
        if color is None or self.settings.dynamic_image_size or img.width == img.height:
            return img  # tiles are squares: Pad2Square leaves them as they are
        side = max(img.width, img.height)
        square = Image.new(img.mode, (side, side), color)
        square.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
        return square

    def sample(self, record: ChatRecord) -> dict[str, torch.Tensor]:
        """The sample of one record (raises on failure)."""
        settings = self.settings
        images = [self._image(path) for path in record.images]
        text, roles = conversation_text(record.turns, settings.template, self.processor.image_token)
        # MindSpeed MM gives each image of an n-image record max_dynamic_patch // n tiles at most.
        most = settings.max_dynamic_patch // len(images) if len(images) > 1 else settings.max_dynamic_patch
        out = self.processor(
            text=text,
            images=images,
            return_tensors="pt",
            crop_to_patches=settings.dynamic_image_size,
            min_patches=settings.min_dynamic_patch,
            max_patches=most,
        )
        ids = out["input_ids"][0]
        labels = assistant_labels(ids.tolist(), roles, self.turn_start_id, self.header_length)
        return {"input_ids": ids, "labels": torch.tensor(labels, dtype=torch.long), "pixel_values": out["pixel_values"]}

    def where(self, record: ChatRecord) -> str:
        return record.where

    def problem(self, record: ChatRecord, err: Exception) -> str:
        return f"{record.where}: {type(err).__name__}: {str(err)[:200]}"

    def __len__(self) -> int:
        return len(self.records) * self.repeat


class InternVLCollator:
    """MindSpeed MM's ``DataCollatorForInternvl``: pads right with ``pad_id`` (labels with -100), concatenates the
    tiles of the batch in order; the attention mask marks each sample's own tokens."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(s["input_ids"]) for s in samples)
        input_ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, sample in enumerate(samples):
            n = len(sample["input_ids"])
            input_ids[i, :n] = torch.as_tensor(sample["input_ids"])
            labels[i, :n] = torch.as_tensor(sample["labels"])
            mask[i, :n] = 1
        pixel_values = torch.cat([s["pixel_values"] for s in samples])
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "pixel_values": pixel_values}


# ------------------------------------------------------------------------------------------------ entry point
def _load_model_side(settings: MultimodalSettings) -> tuple[Any, Any]:
    from transformers import AutoConfig

    from lightning_mm.hf.internvl_processor import ProcessorDirectoryError, load_internvl_processor

    key = "dataset_param.tokenizer_config.from_pretrained"
    fail = _Fail(settings.source)
    if not (settings.model_dir / "config.json").is_file():
        raise fail(key, f"{settings.model_dir} has no config.json (the model directory is needed)")
    try:
        config = AutoConfig.from_pretrained(str(settings.model_dir), local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError) as err:
        raise fail(key, f"cannot read the model config: {str(err)[:300]}") from None
    if config.model_type != "internvl":
        raise fail(key, f"model_type is {config.model_type!r}; Transformers' InternVL format ('internvl') is needed")
    try:
        processor = load_internvl_processor(settings.model_dir)
    except ProcessorDirectoryError as err:
        raise fail(key, str(err)) from None
    except (ValueError, OSError) as err:  # Transformers' own loading errors (an unknown processor class, ...)
        raise fail(key, f"cannot load InternVL's processor: {str(err)[:300]}") from None
    return processor, config


def build_multimodal_datasets(
    dataset_param: Mapping[str, Any],
    collate_param: Mapping[str, Any],
    base_dir: Path,
    source: str,
    strict: bool,
) -> tuple[dict[str, Dataset | None], Callable[[list[dict]], dict], dict[str, DataReport]]:
    """The training dataset, the collate function and the report of MindSpeed MM's ``multimodal`` data config.

    Relative paths resolve against ``base_dir`` (MindSpeed MM's examples assume the working directory). Returns
    ``({"train": dataset, "val": None, "test": None}, collate, {"train": report})``: MindSpeed MM's multimodal
    dataset has one split. Config errors are :class:`DataConfigError` naming ``source`` and the key; bad records
    are counted in the report (``file:line``), or a :class:`DataError` when ``strict``.
    """
    settings = parse_settings(dataset_param, collate_param, base_dir, source)
    processor, model_config = _load_model_side(settings)
    header_length = check_processor(settings, processor, model_config)
    specials = _special_tokens(settings.template, processor)
    report = DataReport("train")
    parts = []
    for data in settings.sources:
        records = read_chat_records(data, specials, report)
        if records:
            repeat = int(data.repeat_time) if data.repeat_time > 1 else 1
            parts.append(InternVLChatDataset(records, repeat, processor, settings, header_length, report, strict))
    if report.problems and strict:
        raise DataError(f"bad records in strict mode ({source}):\n{report.summary(shown=20)}")
    if not parts:
        raise DataError(f"{source}: the multimodal dataset has no usable record:\n{report.summary()}")
    train = parts[0] if len(parts) == 1 else ConcatDataset(parts)
    return {"train": train, "val": None, "test": None}, InternVLCollator(settings.pad_id), {"train": report}
