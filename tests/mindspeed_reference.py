"""A re-telling of MindSpeed MM's sample building (its FSDP2 route, commit 57069cd5), the tests' reference.

Written from ``mindspeed_mm/fsdp/data/data_utils/func_utils/`` function by function: ``convert.py``
(``SharegptDatasetConverter``, ``SupervisedDatasetProcessor._encode_data_example``, ``infer_seqlen``),
``template.py`` (the registered slots, ``Template._encode``, ``_convert_elements_to_ids``,
``ReasoningTemplate.encode_multiturn``), ``mm_plugin.py`` (``MMPluginMixin._preprocess_image``,
``Qwen2VLPlugin._preprocess_image``, the plugins' ``_get_mm_inputs`` and ``process_messages``) and ``collator.py``
(the pixels of a batch: ``get_mm_inputs`` of its images; ``mm_token_type_ids`` for the rope index). It uses only the
model's tokenizer and image processor as Transformers loads them (``AutoTokenizer``, ``AutoImageProcessor``), never
this project's code.
"""

from __future__ import annotations

import math
import re
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from PIL import Image

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


def reference(
    model: Path, name: str, record: dict, data: Path, max_px: int, min_px: int, **overrides: Any
) -> dict[str, torch.Tensor]:
    """MindSpeed MM's sample of ``record`` (its dataset's input ids and labels, its collator's pixels and, for
    the models that take them, ``mm_token_type_ids``: 1 where the id is the image token's)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    args: dict[str, Any] = dict(cutoff_len=1024, train_on_prompt=False, mask_history=False, enable_thinking=True)
    args.update(overrides)
    tokenizer = AutoTokenizer.from_pretrained(model)
    image_processor = AutoImageProcessor.from_pretrained(model)
    template = REF_TEMPLATES[name]
    messages, system = ref_sharegpt(record)
    paths = [data / p for p in record.get("images", [])]
    mm_inputs = ref_get_mm_inputs(paths, image_processor, template["plugin"], max_px, min_px) if paths else {}
    messages = ref_process_messages(messages, mm_inputs, image_processor, template["plugin"])
    pairs = ref_encode_multiturn(tokenizer, messages, system, template, args["enable_thinking"])
    input_ids, labels = ref_encode_data_example(tokenizer, pairs, template, args)
    ids = torch.tensor(input_ids)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor(labels)}
    if template["plugin"] != "qwen2_omni":  # collator.py: where get_rope_index takes them (not Qwen2.5-Omni's)
        image_token_id = tokenizer.convert_tokens_to_ids(REF_PLUGINS[template["plugin"]][1])
        out["mm_token_type_ids"] = (ids == image_token_id).long()
    out.update({k: mm_inputs[k] for k in ("pixel_values", "image_grid_thw") if k in mm_inputs})
    return out
