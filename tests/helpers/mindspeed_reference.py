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
    model: Path,
    name: str,
    record: dict,
    data: Path,
    max_px: int,
    min_px: int,
    video: dict | None = None,
    **overrides: Any,
) -> dict[str, torch.Tensor]:
    """MindSpeed MM's sample of ``record`` (its dataset's input ids and labels, its collator's pixels and, for
    the models that take them, ``mm_token_type_ids``: 1 where the id is the image token's, 2 the video token's).
    ``video``: the data config's video keys (``video_fps``, ``video_maxlen``, ``video_max_pixels``, ...)."""
    import json

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
    videos = [data / p for p in record.get("videos", [])]
    if videos:
        model_type = json.loads((model / "config.json").read_text())["model_type"]
        video_inputs = ref_get_video_mm_inputs(videos, model, model_type, template["plugin"], video or {})
        _, _, bos, eos = REF_PLUGINS[template["plugin"]]
        messages = ref_process_video_messages(messages, video_inputs, template["plugin"], bos, eos)
        video_inputs.pop("video_metadata", None)  # not a model input (its collator hands it on; unused)
        mm_inputs.update(video_inputs)
    pairs = ref_encode_multiturn(tokenizer, messages, system, template, args["enable_thinking"])
    input_ids, labels = ref_encode_data_example(tokenizer, pairs, template, args)
    ids = torch.tensor(input_ids)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor(labels)}
    if template["plugin"] != "qwen2_omni":  # collator.py: where get_rope_index takes them (not Qwen2.5-Omni's)
        image_token_id = tokenizer.convert_tokens_to_ids(REF_PLUGINS[template["plugin"]][1])
        video_token_id = tokenizer.convert_tokens_to_ids(REF_VIDEO_TOKENS[template["plugin"]])
        out["mm_token_type_ids"] = (ids == image_token_id).long() + 2 * (ids == video_token_id).long()
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    out.update({k: mm_inputs[k] for k in (*keys, "second_per_grid_ts", "video_second_per_grid") if k in mm_inputs})
    return out


# ================================================================================ videos (MindSpeed MM's code)
VIDEO_PLACEHOLDER = "<video>"
# template.py: the video token each template's plugin is registered with; mm_plugin.py: how it lays videos out
REF_VIDEO_TOKENS = {
    "qwen2_vl": "<|video_pad|>",
    "qwen3_vl": "<|video_pad|>",
    "qwen2_omni": "<|VIDEO|>",
    "glm4.1v": "<|video|>",
}


def ref_get_video_sample_indices(video_stream: Any, video_fps: float, video_maxlen: int, **kwargs: Any) -> Any:
    """MMPluginMixin._get_video_sample_indices."""
    import numpy as np

    total_frames = video_stream.frames
    if total_frames == 0:  # infinite video
        return np.linspace(0, video_maxlen - 1, video_maxlen).astype(np.int32)
    sample_frames = max(1, math.floor(float(video_stream.duration * video_stream.time_base) * video_fps))
    sample_frames = min(total_frames, video_maxlen, sample_frames)
    return np.linspace(0, total_frames - 1, sample_frames).astype(np.int32)


def ref_regularize_videos(videos: list[Path], **kwargs: Any) -> dict:
    """Qwen2VLPlugin._regularize_videos (file paths), its frames through _regularize_images (resample left at its
    default, True: NEAREST)."""
    import av

    results, fps_per_video = [], []
    for video in videos:
        frames: list = []
        with av.open(str(video), "r") as container:
            video_stream = next(stream for stream in container.streams if stream.type == "video")
            sample_indices = ref_get_video_sample_indices(video_stream, **kwargs)
            container.seek(0)
            for frame_idx, frame in enumerate(container.decode(video_stream)):
                if frame_idx in sample_indices:
                    frames.append(frame.to_image())
            if video_stream.duration is None:
                fps_per_video.append(kwargs.get("video_fps", 2.0))
            else:
                fps_per_video.append(len(sample_indices) / float(video_stream.duration * video_stream.time_base))
        if len(frames) % 2 != 0:
            frames.append(frames[-1])
        frames = [ref_preprocess_image(f, kwargs["image_max_pixels"], kwargs["image_min_pixels"], True) for f in frames]
        results.append(frames)
    return {"videos": results, "fps_per_video": fps_per_video}


# ---------------------------------------------- Transformers 5.24's video processors (they import torchvision)
def ref_video_processor_settings(model: Path, kind: str) -> dict:
    """What ``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor.from_pretrained`` read: ``processor_config.json``'s
    ``video_processor``, else ``video_preprocessor_config.json``, else ``preprocessor_config.json``, over the
    class attributes (``video_processing_qwen2_vl.py`` / ``video_processing_qwen3_vl.py``)."""
    import json

    from transformers.utils.constants import (
        IMAGENET_STANDARD_MEAN,
        IMAGENET_STANDARD_STD,
        OPENAI_CLIP_MEAN,
        OPENAI_CLIP_STD,
    )

    if kind == "qwen2_vl":
        out = dict(size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, image_mean=OPENAI_CLIP_MEAN)
        out.update(image_std=OPENAI_CLIP_STD, patch_size=14, do_sample_frames=False, fps=None, num_frames=None)
    else:
        out = dict(
            size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, image_mean=IMAGENET_STANDARD_MEAN
        )
        out.update(image_std=IMAGENET_STANDARD_STD, patch_size=16, do_sample_frames=True, fps=2, num_frames=None)
    out.update(temporal_patch_size=2, merge_size=2, min_frames=4, max_frames=768, rescale_factor=1 / 255)
    saved: dict = {}
    nested = model / "processor_config.json"
    if nested.is_file() and "video_processor" in json.loads(nested.read_text()):
        saved = json.loads(nested.read_text())["video_processor"]
    else:
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (model / name).is_file():
                saved = json.loads((model / name).read_text())
                break
    size = dict(out["size"], **(saved.get("size") or {}))
    if kind == "qwen2_vl":  # Qwen2VLVideoProcessor.__init__: min_pixels / max_pixels override size
        if saved.get("min_pixels") is not None:
            size["shortest_edge"] = saved["min_pixels"]
        if saved.get("max_pixels") is not None:
            size["longest_edge"] = saved["max_pixels"]
    out.update({k: v for k, v in saved.items() if k in out and k != "size"})
    out["size"] = size
    return out


def ref_smart_resize(kind: str, num_frames: int, height: int, width: int, factor: int, min_px: int, max_px: int):
    """``smart_resize`` of video_processing_qwen2_vl.py (per frame) or video_processing_qwen3_vl.py (all frames)."""
    if kind == "qwen3_vl":
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height = int(height * scale)
            width = int(width * scale)
        t_bar = round(num_frames / 2) * 2
    else:
        num_frames, t_bar = 1, 1
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if t_bar * h_bar * w_bar > max_px:
        beta = math.sqrt((num_frames * height * width) / max_px)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_px:
        beta = math.sqrt(min_px / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def ref_tv_resize(image: torch.Tensor, size: list[int]) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize_image, bicubic with antialias, a uint8 tensor on the CPU: an
    unchanged size returns the input; else ``interpolate`` on the uint8 tensor itself
    (``_do_native_uint8_resize_on_cpu(BICUBIC)`` is True), over ``(-1, C, H, W)``."""
    shape = image.shape
    if list(shape[-2:]) == list(size):
        return image
    out = torch.nn.functional.interpolate(
        image.reshape(-1, *shape[-3:]), size=size, mode="bicubic", align_corners=False, antialias=True
    )
    return out.reshape(*shape[:-2], *size)


def ref_video_processor(videos: list[list[Image.Image]], settings: dict, kind: str, metadata: list | None) -> dict:
    """``BaseVideoProcessor.preprocess`` -> ``_decode_and_sample_videos`` (Qwen3-VL: ``sample_frames`` with the
    given metadata), ``_prepare_input_videos``, then ``Qwen2VLVideoProcessor._preprocess`` /
    ``Qwen3VLVideoProcessor._preprocess``: ``resize``, ``rescale_and_normalize`` (fused), ``patchify``."""
    import numpy as np

    s = settings
    tensors, metadata_out = [], []
    for i, frames in enumerate(videos):
        array = np.stack([np.array(f) for f in frames])  # make_batched_videos
        if s["do_sample_frames"]:  # Qwen3VLVideoProcessor.sample_frames
            meta = dict(metadata[i])
            total = meta["total_num_frames"]
            fps = s["fps"]
            num_frames = s["num_frames"]
            if num_frames is None and fps is not None:
                num_frames = int(total / meta["fps"] * fps)
                num_frames = min(max(num_frames, s["min_frames"]), s["max_frames"], total)
            if num_frames is None:
                num_frames = min(max(total, s["min_frames"]), s["max_frames"])
            indices = np.linspace(0, total - 1, num_frames).round().astype(int)
            array = array[indices]
            meta["frames_indices"] = indices
            metadata_out.append(meta)
        tensors.append(torch.from_numpy(array).permute(0, 3, 1, 2).contiguous())
    pixel_values, grids = [], []
    p, m, tp = s["patch_size"], s["merge_size"], s["temporal_patch_size"]
    for video in tensors:
        stacked = video[None]  # group_videos_by_shape: (B, T, C, H, W)
        h, w = ref_smart_resize(
            kind, stacked.shape[1], *stacked.shape[-2:], p * m, s["size"]["shortest_edge"], s["size"]["longest_edge"]
        )
        stacked = ref_tv_resize(stacked, [h, w])
        mean = torch.tensor(s["image_mean"]) * (1.0 / s["rescale_factor"])
        std = torch.tensor(s["image_std"]) * (1.0 / s["rescale_factor"])
        stacked = stacked.to(torch.float32)
        stacked = stacked.sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))  # torchvision normalize
        b, t, c, hh, ww = stacked.shape
        if pad := -t % tp:
            stacked = torch.cat((stacked, stacked[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
            t += pad
        gt, gh, gw = t // tp, hh // p, ww // p
        patches = stacked.view(b, gt, tp, c, gh // m, m, p, gw // m, m, p)
        patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        pixel_values.append(patches.reshape(b, gt * gh * gw, c * tp * p * p))
        grids.append([gt, gh, gw])
    out = {"pixel_values_videos": torch.cat(pixel_values, dim=0).reshape(-1, pixel_values[0].shape[-1])}
    out["video_grid_thw"] = torch.tensor(grids)
    if metadata_out:
        out["video_metadata"] = metadata_out
    return out


def ref_get_video_mm_inputs(paths: list[Path], model: Path, model_type: str, plugin: str, pre: dict) -> dict:
    """Qwen2VLPlugin / Qwen3VLPlugin / Qwen2OmniPlugin ._get_mm_inputs (videos), with the processor attributes
    MindSpeed MM's ``get_processor`` sets from the data config (``pre``)."""
    kind = "qwen3_vl" if plugin == "qwen3_vl" else "qwen2_vl"
    settings = ref_video_processor_settings(model, kind)
    data = ref_regularize_videos(
        paths,
        image_max_pixels=pre.get("video_max_pixels", 256 * 256),
        image_min_pixels=pre.get("video_min_pixels", 16 * 16),
        video_fps=pre.get("video_fps", 2.0),
        video_maxlen=pre.get("video_maxlen", 128),
    )
    temporal_patch_size = 2  # getattr(image_processor, "temporal_patch_size", 2): 2 for the tiny models
    if plugin == "qwen3_vl":
        metadata = [
            {"fps": pre.get("video_fps", 24.0), "duration": len(v), "total_num_frames": len(v)} for v in data["videos"]
        ]
        return ref_video_processor(data["videos"], settings, kind, metadata)
    out = ref_video_processor(data["videos"], settings, kind, None)
    seconds = [temporal_patch_size / fps for fps in data["fps_per_video"]]
    if plugin == "qwen2_omni":
        out["video_second_per_grid"] = torch.tensor(seconds)
    elif model_type == "qwen2_5_vl":  # "second_per_grid_ts" in Qwen2_5_VLProcessor.model_input_names
        out["second_per_grid_ts"] = torch.tensor(seconds)  # a list there; the collator's tensor here
    return out


def ref_process_video_messages(messages: list[dict], mm_inputs: dict, plugin: str, bos: str, eos: str) -> list[dict]:
    """The plugins' process_messages for ``<video>`` (Qwen3VLPlugin: every video takes the first video's frame
    count and the metadata of the message's index, as upstream does; the records here keep to one video in the
    first message or videos of one length, where that is what each video has)."""
    from transformers import Qwen3VLProcessor

    messages = deepcopy(messages)
    video_token = REF_VIDEO_TOKENS[plugin]
    grids = mm_inputs["video_grid_thw"]
    merge_length = 4  # image_processor.merge_size ** 2 (video_processor.merge_size for Qwen3VLPlugin): 2 here
    num_video_tokens = 0
    for idx, message in enumerate(messages):
        content = message["content"]
        while VIDEO_PLACEHOLDER in content:
            if plugin == "qwen3_vl":
                num_frames = grids[0][0]
                metadata = mm_inputs["video_metadata"][idx]
                timestamps = Qwen3VLProcessor._calculate_timestamps(
                    None, metadata["frames_indices"], metadata["fps"], 2
                )
                video_structure = ""
                for frame_index in range(num_frames):
                    video_seqlen = grids[num_video_tokens][1:].prod() // merge_length
                    video_structure += f"<{timestamps[frame_index]:.1f} seconds>{bos}{video_token * video_seqlen}{eos}"
                content = content.replace(VIDEO_PLACEHOLDER, video_structure, 1)
            else:
                video_seqlen = grids[num_video_tokens].prod() // merge_length
                content = content.replace(VIDEO_PLACEHOLDER, f"{bos}{video_token * video_seqlen}{eos}", 1)
            num_video_tokens += 1
        message["content"] = content
    return messages
