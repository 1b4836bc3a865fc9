"""Samples of MindSpeed MM's named templates equal MindSpeed MM's own (its FSDP2 route, commit 57069cd5).

The reference below RE-TELLS MindSpeed MM's code, function by function, from
``mindspeed_mm/fsdp/data/data_utils/func_utils/`` (``convert.py``: ``SharegptDatasetConverter``,
``SupervisedDatasetProcessor._encode_data_example``, ``infer_seqlen``; ``template.py``: the registered slots,
``Template._encode``, ``_convert_elements_to_ids``, ``ReasoningTemplate.encode_multiturn``; ``mm_plugin.py``:
``MMPluginMixin._preprocess_image``, ``Qwen2VLPlugin._preprocess_image``, the plugins' ``_get_mm_inputs`` and
``process_messages``) and ``collator.py`` (the pixels of a batch: ``get_mm_inputs`` of the sample's images). It
uses only the tiny models' tokenizer and image processor as Transformers loads them (``AutoTokenizer``,
``AutoImageProcessor``), never this project's code. Each sample built through ``MMDataModule(data_config=...)`` is
compared with it: input ids, labels, pixel values and image grids, for each template on a tiny model of its family
(``tests/tiny_vlms.py``, ``examples/tiny_families.py``): a picture above ``image_max_pixels``, one below the image
processor's own minimum and narrower than 28 pixels, several images, several turns, system prompts (default, column,
turn with white space), existing thoughts, the label modes, and cuts at small ``cutoff_len``.
"""

from __future__ import annotations

import json
import math
import re
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from examples.tiny_families import write_tiny_family
from lightning_mm import MMDataModule
from tests.tiny_vlms import write_tiny_vlm

IGNORE_INDEX = -100
IMAGE_PLACEHOLDER = "<image>"

# ================================================================================ the reference (MindSpeed MM's code)
# template.py, _register_template(...): the slots of each template this project takes, and its plugin.
_QWEN = dict(
    format_user="<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",
    format_assistant="{{content}}<|im_end|>\n",
    format_system="<|im_start|>system\n{{content}}<|im_end|>\n",
    format_prefix=None,
    efficient_eos=False,
)
_GLM = dict(
    format_user="<|user|>\n{{content}}<|assistant|>",
    format_assistant="\n{{content}}",
    format_system="<|system|>\n{{content}}",
    format_prefix="[gMASK]<sop>",
    default_system="",
    efficient_eos=True,
    reasoning=True,
    plugin="glm4.1v",
)
REF_TEMPLATES = {
    "qwen2vl": dict(_QWEN, default_system="You are a helpful assistant.", reasoning=False, plugin="qwen2_vl"),
    "qwen3_vl": dict(_QWEN, default_system="", reasoning=True, plugin="qwen3_vl"),
    "qwen3_vl_nothink": dict(_QWEN, default_system="", reasoning=False, plugin="qwen3_vl"),
    "qwen3_6": dict(_QWEN, default_system="", reasoning=True, plugin="qwen3_vl"),
    "qwen2_omni": dict(_QWEN, default_system="You are a helpful assistant.", reasoning=False, plugin="qwen2_omni"),
    "glm4.1v": _GLM,
    "glm4v_moe": _GLM,
}
# mm_plugin.py: get_mm_plugin(name, image_token=...): (resample in _regularize_images, image token, its markers)
REF_PLUGINS = {
    "qwen2_vl": (True, "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),  # Qwen2VLPlugin (resample default)
    "qwen3_vl": (False, "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),  # Qwen3VLPlugin: resample=False
    "qwen2_omni": (False, "<|IMAGE|>", "<|vision_bos|>", "<|vision_eos|>"),  # Qwen2OmniPlugin: resample=False
    "glm4.1v": (False, "<|image|>", "<|begin_of_image|>", "<|end_of_image|>"),  # GLM4VPlugin: resample=False
}
THOUGHT_WORDS = ("<think>", "</think>")


def ref_preprocess_image(image: Image.Image, image_max_pixels: int, image_min_pixels: int, resample: bool):
    """MMPluginMixin._preprocess_image, then Qwen2VLPlugin._preprocess_image (all four plugins derive from it)."""
    if (image.width * image.height) > image_max_pixels:
        resize_factor = math.sqrt(image_max_pixels / (image.width * image.height))
        width, height = int(image.width * resize_factor), int(image.height * resize_factor)
        if resample:
            image = image.resize((width, height), resample=Image.Resampling.NEAREST)
        else:
            image = image.resize((width, height))
    if (image.width * image.height) < image_min_pixels:
        resize_factor = math.sqrt(image_min_pixels / (image.width * image.height))
        width, height = int(image.width * resize_factor), int(image.height * resize_factor)
        if resample:
            image = image.resize((width, height), resample=Image.Resampling.NEAREST)
        else:
            image = image.resize((width, height))
    if image.mode != "RGB":
        image = image.convert("RGB")
    # Qwen2VLPlugin._preprocess_image
    if min(image.width, image.height) < 28:
        width, height = max(image.width, 28), max(image.height, 28)
        image = image.resize((width, height))
    if image.width / image.height > 200:
        width, height = image.height * 180, image.height
        image = image.resize((width, height))
    if image.height / image.width > 200:
        width, height = image.width, image.width * 180
        image = image.resize((width, height))
    return image


def ref_get_mm_inputs(paths: list[Path], image_processor: Any, plugin: str, max_px: int, min_px: int) -> dict:
    """The plugin's _get_mm_inputs: _regularize_images (Image.open each path, _preprocess_image), then
    ``image_processor(images, return_tensors="pt")`` with the processor's own settings."""
    resample = REF_PLUGINS[plugin][0]
    images = []
    for path in paths:
        with Image.open(path) as image_obj:
            images.append(ref_preprocess_image(image_obj, max_px, min_px, resample).copy())
    return dict(image_processor(images, return_tensors="pt"))


def ref_process_messages(messages: list[dict], mm_inputs: dict, image_processor: Any, plugin: str) -> list[dict]:
    """Qwen2VLPlugin / Qwen3VLPlugin / Qwen2OmniPlugin / GLM4VPlugin.process_messages (images)."""
    _, image_token, bos, eos = REF_PLUGINS[plugin]
    messages = deepcopy(messages)
    merge_length = image_processor.merge_size**2
    image_grid_thw = mm_inputs.get("image_grid_thw", [])
    num_image_tokens = 0
    for message in messages:
        content = message["content"]
        while IMAGE_PLACEHOLDER in content:
            image_seqlen = image_grid_thw[num_image_tokens].prod() // merge_length
            content = content.replace(IMAGE_PLACEHOLDER, f"{bos}{image_token * image_seqlen}{eos}", 1)
            num_image_tokens += 1
        message["content"] = content
    return messages


def ref_convert_elements_to_ids(tokenizer: Any, elements: list[str]) -> list[int]:
    """Template._convert_elements_to_ids (string elements)."""
    token_ids = []
    for elem in elements:
        if len(elem) != 0:
            token_ids += tokenizer.encode(elem, add_special_tokens=False)
    return token_ids


def ref_encode(tokenizer: Any, messages: list[dict], system: str, template: dict) -> list[list[int]]:
    """Template._encode (no tools)."""
    system = system or template["default_system"]
    encoded_messages = []
    for i, message in enumerate(messages):
        elements = []
        if i == 0:
            elements += [template["format_prefix"]] if template["format_prefix"] else []  # EmptyFormatter.apply
            if system:
                elements += [template["format_system"].replace("{{content}}", system, 1)]
        if message["role"] == "user":
            elements += [template["format_user"].replace("{{content}}", message["content"], 1)]
        else:
            elements += [template["format_assistant"].replace("{{content}}", message["content"], 1)]
        encoded_messages.append(ref_convert_elements_to_ids(tokenizer, elements))
    return encoded_messages


def ref_encode_multiturn(tokenizer: Any, messages: list[dict], system: str, template: dict, enable_thinking: bool):
    """Template.encode_multiturn, or ReasoningTemplate.encode_multiturn for the reasoning templates.

    ``enable_thinking`` is the template's attribute; MindSpeed MM's FSDP route leaves it at its registered default
    (True) whatever the data config says, this project passes the config's value (a documented difference)."""
    if not template["reasoning"]:
        encoded = ref_encode(tokenizer, messages, system, template)
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

    def remove_thought(content: str) -> str:
        pattern = re.compile(f"{re.escape(THOUGHT_WORDS[0])}(.*?){re.escape(THOUGHT_WORDS[1])}", re.DOTALL)
        return re.sub(pattern, "", content).lstrip("\n")

    thought_ids = tokenizer.encode(f"{THOUGHT_WORDS[0]}\n\n{THOUGHT_WORDS[1]}\n\n", add_special_tokens=False)
    messages = deepcopy(messages)
    if enable_thinking is False:
        for i in range(1, len(messages), 2):
            messages[i]["content"] = remove_thought(messages[i]["content"])
    encoded = ref_encode(tokenizer, messages, system, template)
    for i in range(0, len(messages), 2):
        if THOUGHT_WORDS[0] not in messages[i + 1]["content"] and THOUGHT_WORDS[1] not in messages[i + 1]["content"]:
            if not enable_thinking:
                encoded[i] += thought_ids
            else:
                encoded[i + 1] = thought_ids + encoded[i + 1]
    return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]


def ref_infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """convert.py: infer_seqlen."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    max_source_len = max(cutoff_len - new_target_len, 0)
    new_source_len = min(max_source_len, source_len)
    return new_source_len, new_target_len


def ref_encode_data_example(tokenizer: Any, pairs: list, template: dict, args: dict) -> tuple[list, list]:
    """SupervisedDatasetProcessor._encode_data_example, after process_messages and encode_multiturn."""
    input_ids, labels = [], []
    total_length = len(input_ids) + (1 if template["efficient_eos"] else 0)
    if args["mask_history"]:
        pairs = pairs[::-1]
    for turn_idx, (source_ids, target_ids) in enumerate(pairs):
        if total_length >= args["cutoff_len"]:
            break
        source_len, target_len = ref_infer_seqlen(len(source_ids), len(target_ids), args["cutoff_len"] - total_length)
        source_ids = source_ids[:source_len]
        target_ids = target_ids[:target_len]
        total_length += source_len + target_len
        if args["train_on_prompt"]:
            source_label = source_ids
        elif template["efficient_eos"]:
            source_label = [tokenizer.eos_token_id] + [IGNORE_INDEX] * (source_len - 1)
        else:
            source_label = [IGNORE_INDEX] * source_len
        if args["mask_history"] and turn_idx != 0:
            target_label = [IGNORE_INDEX] * target_len
        else:
            target_label = target_ids
        if args["mask_history"]:
            input_ids = source_ids + target_ids + input_ids
            labels = source_label + target_label + labels
        else:
            input_ids += source_ids + target_ids
            labels += source_label + target_label
    if template["efficient_eos"]:
        input_ids += [tokenizer.eos_token_id]
        labels += [tokenizer.eos_token_id]
    return input_ids, labels


def ref_sharegpt(record: dict) -> tuple[list[dict], str]:
    """SharegptDatasetConverter (tags as ATTR names them): a leading system turn stripped, each turn stripped."""
    messages = record["messages"]
    if messages[0]["role"] == "system":
        system = (messages[0].get("content") or "").strip()
        messages = messages[1:]
    else:
        system = record.get("system") or ""
    return [{"role": m["role"], "content": (m.get("content") or "").strip()} for m in messages], system


def reference(model: Path, name: str, record: dict, data: Path, **overrides: Any) -> dict[str, torch.Tensor]:
    """MindSpeed MM's sample of ``record`` (its dataset's input ids and labels, its collator's pixels)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    args = dict(cutoff_len=1024, train_on_prompt=False, mask_history=False, enable_thinking=True)
    args.update(
        max_px=MAX_PIXELS, min_px=MIN_PIXELS, **{k: v for k, v in overrides.items() if k not in ("max_px", "min_px")}
    )
    args.update({k: v for k, v in overrides.items() if k in ("max_px", "min_px")})
    tokenizer = AutoTokenizer.from_pretrained(model)
    image_processor = AutoImageProcessor.from_pretrained(model)
    template = REF_TEMPLATES[name]
    messages, system = ref_sharegpt(record)
    paths = [data / p for p in record.get("images", [])]
    mm_inputs = (
        ref_get_mm_inputs(paths, image_processor, template["plugin"], args["max_px"], args["min_px"]) if paths else {}
    )
    messages = ref_process_messages(messages, mm_inputs, image_processor, template["plugin"])
    pairs = ref_encode_multiturn(tokenizer, messages, system, template, args["enable_thinking"])
    input_ids, labels = ref_encode_data_example(tokenizer, pairs, template, args)
    out = {"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels)}
    out.update({k: mm_inputs[k] for k in ("pixel_values", "image_grid_thw") if k in mm_inputs})
    return out


# ================================================================================ the data
ATTR = {
    "system": "system",
    "images": "images",
    "messages": "messages",
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "system_tag": "system",
}
MAX_PIXELS = 64 * 64
MIN_PIXELS = 32 * 32
IMAGES = {"big.png": (300, 200), "small.png": (20, 30), "a.png": (60, 40), "b.png": (28, 84), "p.png": (45, 45)}
FAMILY_OF = {
    "qwen2vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_nothink": "qwen3_vl",
    "qwen2_omni": "qwen2_5_omni_thinker",
    "glm4.1v": "glm4v",
    "glm4v_moe": "glm4v_moe",
}


def _record(turns: list[tuple[str, str]], images: list[str] | None = None, **extra: Any) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns], "images": images or [], **extra}


RECORDS = {
    "large picture": _record(
        [("user", "<image>What is in this picture?"), ("assistant", "A red square.")], ["big.png"]
    ),
    "small picture": _record([("user", "<image>How many?"), ("assistant", "One dog.")], ["small.png"]),
    "multi-image": _record(
        [("user", "Two <image> and <image> shapes?"), ("assistant", "Yes, two.")],
        ["a.png", "b.png"],
        system="Be brief.",
    ),
    "multi-turn": _record(
        [
            ("system", "  You are terse.\n"),
            ("user", " <image>Describe the image.\n"),
            ("assistant", "<think>cats</think>\n\nTwo cats. "),
            ("user", "How many?"),
            ("assistant", "The answer is 2."),
            ("user", "Left or right?"),
            ("assistant", "left"),
        ],
        ["p.png"],
    ),
    "text only": _record([("user", "Hello world!"), ("assistant", "Hello! How many shapes? 0 1 2 3.")]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mindspeed")
    out = {f: write_tiny_vlm(root / f, f) for f in ("qwen2_5_vl", "qwen3_vl")}
    out.update({f: write_tiny_family(root / f, f) for f in ("glm4v", "glm4v_moe", "qwen2_5_omni_thinker")})
    return out


def _dataset(tmp: Path, monkeypatch, model: Path, name: str, records: list[dict], basic: dict | None = None, **pre):
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for i, (image, size) in enumerate(IMAGES.items()):
        g = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(data / image)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {
        "dataset_param": {
            "dataset_type": "huggingface",
            "preprocess_parameters": {
                "model_name_or_path": str(model),
                "image_max_pixels": MAX_PIXELS,
                "image_min_pixels": MIN_PIXELS,
                **pre,
            },
            "basic_parameters": {"template": name, "dataset_dir": "./data", "dataset": "./data/train.jsonl"}
            | (basic or {}),
            "attr": ATTR,
        },
        "dataloader_param": {"dataloader_mode": "sampler", "collate_param": {}},
        "strict": True,
    }
    (tmp / "data.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp)
    module = MMDataModule(data_config=tmp / "data.json")
    module.setup()
    _dataset.module = module  # type: ignore[attr-defined]
    return module._splits["train"], data


def _assert_same(sample: dict, ref: dict) -> None:
    for key, value in ref.items():
        assert key in sample, key
        assert sample[key].shape == value.shape, (key, sample[key].shape, value.shape)
        assert torch.equal(sample[key], value.to(sample[key].dtype)), key
    assert set(sample) - set(ref) <= {"attention_mask", "mm_token_type_ids"}
    assert torch.equal(sample["attention_mask"], torch.ones_like(sample["input_ids"]))


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_samples_equal_mindspeed_mm(name, models, tmp_path, monkeypatch):
    model = models[FAMILY_OF[name]]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, list(RECORDS.values()))
    for i, (what, record) in enumerate(RECORDS.items()):
        sample = dataset[i]
        ref = reference(model, name, record, data)
        try:
            _assert_same(sample, ref)
        except AssertionError as err:
            raise AssertionError(f"{name}, {what}: {err}") from None


@pytest.mark.parametrize("name", ["qwen2vl", "qwen3_vl", "glm4.1v"])
@pytest.mark.parametrize(
    "flags",
    [{"train_on_prompt": True}, {"mask_history": True}, {"train_on_prompt": True, "mask_history": True}],
    ids=["train_on_prompt", "mask_history", "both"],
)
def test_label_modes_equal_mindspeed_mm(name, flags, models, tmp_path, monkeypatch):
    model = models[FAMILY_OF[name]]
    record = RECORDS["multi-turn"]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, [record], flags)
    _assert_same(dataset[0], reference(model, name, record, data, **flags))


@pytest.mark.parametrize("name", ["qwen2vl", "qwen3_vl", "glm4.1v"])
@pytest.mark.parametrize("flags", [{}, {"mask_history": True}], ids=["plain", "mask_history"])
def test_cutoff_len_cuts_each_turn_in_proportion_as_mindspeed_mm(name, flags, models, tmp_path, monkeypatch):
    model = models[FAMILY_OF[name]]
    record = RECORDS["multi-turn"]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, [record], {"cutoff_len": 10_000} | flags)
    full = len(dataset[0]["input_ids"])
    # Past the image (the first prompt, with its image tokens, and its answer); then the later turns are cut.
    first = reference(model, name, record | {"messages": record["messages"][:3]}, data)
    # With mask_history the last turns come first, and the first turn (the image's) is cut at its end.
    cutoffs = (full - 3, full - 1) if flags else (len(first["input_ids"]) + 9, len(first["input_ids"]) + 4, full - 3)
    for cutoff in cutoffs:
        dataset, data = _dataset(tmp_path, monkeypatch, model, name, [record], {"cutoff_len": cutoff} | flags)
        ref = reference(model, name, record, data, cutoff_len=cutoff, **flags)
        assert len(ref["input_ids"]) < full
        _assert_same(dataset[0], ref)
    text = RECORDS["text only"]
    for cutoff in (5, 9, 14):
        dataset, data = _dataset(tmp_path, monkeypatch, model, name, [text], {"cutoff_len": cutoff} | flags)
        _assert_same(dataset[0], reference(model, name, text, data, cutoff_len=cutoff, **flags))


def test_a_cut_through_an_image_is_refused_by_name(models, tmp_path, monkeypatch):
    """MindSpeed MM would build a sample whose image tokens do not match its pixels (the model then fails)."""
    from lightning_mm.datamodules.records import DataError

    model = models["qwen2_5_vl"]
    dataset, _ = _dataset(tmp_path, monkeypatch, model, "qwen2vl", [RECORDS["large picture"]], {"cutoff_len": 24})
    with pytest.raises(DataError, match="cutoff_len 24 cuts the sample through its images' tokens"):
        dataset[0]


@pytest.mark.parametrize("name", ["qwen3_vl", "glm4.1v"])
def test_enable_thinking_false_makes_the_empty_thought_prompt(name, models, tmp_path, monkeypatch):
    """MindSpeed MM's ReasoningTemplate with ``enable_thinking = False`` (its FSDP route never sets it: a
    documented difference, the config's value is honoured here)."""
    model = models[FAMILY_OF[name]]
    record = RECORDS["multi-turn"]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, [record], {"enable_thinking": False})
    _assert_same(dataset[0], reference(model, name, record, data, enable_thinking=False))


def test_qwen3_6_on_a_qwen3_vl_processor(models):
    """``qwen3_6`` (Qwen3.5 / Qwen3.6) is ``qwen3_vl``'s slots and plugin; checked on the builder directly (no tiny
    Qwen3.5 directory here)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from lightning_mm.hf.mindspeed_samples import MINDSPEED_FORMATS, MindSpeedSampleBuilder
    from lightning_mm.hf.vlm_processor import load_vlm_processor

    model = models["qwen3_vl"]
    builder = MindSpeedSampleBuilder(
        load_vlm_processor(model).processor,
        MINDSPEED_FORMATS["qwen3_6"],
        image_max_pixels=MAX_PIXELS,
        image_min_pixels=MIN_PIXELS,
        cutoff_len=1024,
    )
    record = RECORDS["text only"]
    messages, system = ref_sharegpt(record)
    sample = builder(messages, system, [])
    tokenizer = AutoTokenizer.from_pretrained(model)
    AutoImageProcessor.from_pretrained(model)
    pairs = ref_encode_multiturn(tokenizer, messages, system, REF_TEMPLATES["qwen3_6"], True)
    args = dict(cutoff_len=1024, train_on_prompt=False, mask_history=False)
    ids, labels = ref_encode_data_example(tokenizer, pairs, REF_TEMPLATES["qwen3_6"], args)
    assert sample["input_ids"].tolist() == ids and sample["labels"].tolist() == labels


@pytest.mark.parametrize("name", ["qwen2vl", "qwen3_vl"])
def test_the_filler_image_is_mindspeed_mms(name, models, tmp_path, monkeypatch):
    """MindSpeed MM's collator: a batch without images gets one 64x64 white image through process_messages and
    get_mm_inputs, its tokens appended to the first sample, masked."""
    from transformers import AutoImageProcessor, AutoTokenizer

    model = models[FAMILY_OF[name]]
    text = RECORDS["text only"]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, [text])
    batch = _dataset.module.train_dataloader().collate_fn([dataset[0]])  # type: ignore[attr-defined]
    tokenizer = AutoTokenizer.from_pretrained(model)
    image_processor = AutoImageProcessor.from_pretrained(model)
    plugin = REF_TEMPLATES[name]["plugin"]
    fake = Image.new("RGB", (64, 64), (255, 255, 255))
    resample = REF_PLUGINS[plugin][0]
    mm_inputs = dict(
        image_processor([ref_preprocess_image(fake, MAX_PIXELS, MIN_PIXELS, resample)], return_tensors="pt")
    )
    messages = ref_process_messages(
        [{"role": "user", "content": IMAGE_PLACEHOLDER}], mm_inputs, image_processor, plugin
    )
    fake_ids = tokenizer.encode(messages[0]["content"], add_special_tokens=False)
    ref = reference(model, name, text, data)
    assert batch["input_ids"][0].tolist() == ref["input_ids"].tolist() + fake_ids
    assert batch["labels"][0].tolist() == ref["labels"].tolist() + [IGNORE_INDEX] * len(fake_ids)
    assert batch["attention_mask"][0].tolist() == [1] * len(ref["input_ids"]) + [0] * len(fake_ids)
    assert torch.equal(batch["pixel_values"], mm_inputs["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], mm_inputs["image_grid_thw"])
