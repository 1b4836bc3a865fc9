"""Samples of MindSpeed MM's named chat templates, built as its FSDP2 data path builds them.

MindSpeed MM (``mindspeed_mm/fsdp/data/data_utils/func_utils/``) does not render a conversation with the model's
chat template: each template is a set of text slots (``template.py``), each message is encoded on its own
(``Template._encode``: the prefix and system slots with the first message, every element tokenized separately,
``add_special_tokens=False``), and the images are bounded by the template's plugin (``mm_plugin.py``,
``_preprocess_image``) before the image processor runs with its OWN settings (``image_processor(images,
return_tensors="pt")``, no size). Each ``<image>`` becomes the plugin's vision markers around ``grid.prod() //
merge_size**2`` image tokens. ``SupervisedDatasetProcessor._encode_data_example`` (``convert.py``) then cuts each
(prompt, answer) pair in proportion (``infer_seqlen``) to fit ``cutoff_len`` and labels the answers (with
``efficient_eos`` templates, GLM-4.1V's, the first token of each prompt is labelled with the EOS id and an EOS is
appended). :class:`MindSpeedSampleBuilder` does the same, step by step.

What differs here, on purpose:

- ``enable_thinking: false`` is honoured (the empty thought is prompt, existing thoughts are removed). MindSpeed
  MM's FSDP route reads the key but never hands it to its template, so there the empty thought is always trained.
- A sample whose cut (``cutoff_len``) splits an image's tokens, or leaves no trained token, is an error for that
  record (it is replaced and counted, or stops a strict run): MindSpeed MM builds it, and the model then fails
  (image features and image tokens differ) or trains on nothing.
- The tokenizer is not changed: MindSpeed MM adds a template's stop words as special tokens (and for the Qwen
  templates makes ``<|im_end|>`` the EOS). Neither changes the samples of these templates unless a text holds a
  stop word that is not yet a token of the tokenizer (GLM-4.1V's ``</answer>``), which would need a resized
  embedding.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_mm.errors import ConfigError

if TYPE_CHECKING:
    from lightning_mm.hf.qwen_video import QwenVideoProcessor

__all__ = ["MindSpeedTemplate", "MINDSPEED_FORMATS", "MindSpeedSampleBuilder", "VideoLayout", "infer_seqlen"]

_IMAGE = "<image>"
_VIDEO = "<video>"
_IGNORE = -100
_QWEN_USER = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"
_QWEN_ASSISTANT = "{{content}}<|im_end|>\n"
_QWEN_SYSTEM = "<|im_start|>system\n{{content}}<|im_end|>\n"


@dataclass(frozen=True)
class MindSpeedTemplate:
    """The slots and plugin of one MindSpeed MM template (``template.py``'s ``_register_template``)."""

    user: str
    assistant: str
    system: str
    prefix: str = ""
    default_system: str = ""
    efficient_eos: bool = False
    reasoning: bool = False
    """``ReasoningTemplate``: an empty thought is added to each answer that has none."""
    nearest: bool = False
    """The plugin bounds images with a NEAREST resize (``Qwen2VLPlugin``); else with PIL's default resample."""
    image_token: str = "<|image_pad|>"
    vision_bos: str = "<|vision_start|>"
    vision_eos: str = "<|vision_end|>"
    thought: tuple[str, str] = ("<think>", "</think>")
    video: str | None = None
    """How the plugin lays out a video's tokens: ``qwen2_vl`` (``Qwen2VLPlugin``: one run of video tokens),
    ``qwen3_vl`` (``Qwen3VLPlugin``: ``<t seconds>`` and a run per temporal patch), ``qwen2_omni``
    (``Qwen2OmniPlugin``: one run, ``video_second_per_grid``); ``None``: videos are refused (:attr:`no_video`)."""
    video_token: str = "<|video_pad|>"
    no_video: str = ""
    """Why the template refuses videos here."""


def _qwen(**kwargs: Any) -> MindSpeedTemplate:
    return MindSpeedTemplate(_QWEN_USER, _QWEN_ASSISTANT, _QWEN_SYSTEM, **kwargs)


_GLM = dict(
    user="<|user|>\n{{content}}<|assistant|>",
    assistant="\n{{content}}",
    system="<|system|>\n{{content}}",
    prefix="[gMASK]<sop>",
    efficient_eos=True,
    reasoning=True,
    image_token="<|image|>",
    vision_bos="<|begin_of_image|>",
    vision_eos="<|end_of_image|>",
    video_token="<|video|>",
)
_GLM_NO_VIDEO = (
    "MindSpeed MM's GLM4VPlugin hands Transformers 5's video processor metadata it does not take "
    "(`total_frames`), so MindSpeed MM itself cannot build GLM-4.1V video samples to compare with"
)
MINDSPEED_FORMATS: dict[str, MindSpeedTemplate] = {
    "qwen2vl": _qwen(default_system="You are a helpful assistant.", nearest=True, video="qwen2_vl"),
    "qwen3_vl": _qwen(reasoning=True, video="qwen3_vl"),
    "qwen3_vl_nothink": _qwen(video="qwen3_vl"),
    "qwen3_6": _qwen(reasoning=True, video="qwen3_vl"),
    "qwen2_omni": _qwen(
        default_system="You are a helpful assistant.",
        image_token="<|IMAGE|>",
        vision_bos="<|vision_bos|>",
        vision_eos="<|vision_eos|>",
        video="qwen2_omni",
        video_token="<|VIDEO|>",
    ),
    "glm4.1v": MindSpeedTemplate(**_GLM, no_video=_GLM_NO_VIDEO),  # type: ignore[arg-type]
    "glm4v_moe": MindSpeedTemplate(**_GLM, no_video=_GLM_NO_VIDEO),  # type: ignore[arg-type]
}
"""MindSpeed MM's templates (``mindspeed_mm/fsdp/data/data_utils/func_utils/template.py``) for the families that
train here, for text and images (the tool slots of ``qwen3_6`` are not used: tool turns are refused)."""


@dataclass(frozen=True)
class VideoLayout:
    """What a video's ``<video>`` expands to: its grid ``(t, h, w)`` (``video_grid_thw``) and, for
    ``Qwen3VLPlugin``, the timestamp (seconds) of each temporal patch."""

    grid: tuple[int, int, int]
    stamps: tuple[float, ...] = ()


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """How many prompt and answer tokens of one pair fit in ``cutoff_len`` (MindSpeed MM's ``infer_seqlen``)."""
    if target_len * 2 < cutoff_len:
        max_target = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target = cutoff_len - source_len
    else:
        max_target = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target = min(max_target, target_len)
    new_source = min(max(cutoff_len - new_target, 0), source_len)
    return new_source, new_target


class MindSpeedSampleBuilder:
    """Turns ``(messages, system, images)`` into MindSpeed MM's sample of template ``template``, plus the keys
    the model's forward takes (``mm_token_type_ids`` where the processor makes them).

    ``messages`` alternate ``{"role": "user" | "assistant", "content": str}`` (stripped, as MindSpeed MM's
    sharegpt converter leaves them), user first, assistant last; ``images`` are PIL images as decoded.
    ``cutoff_len`` ``None`` cuts nothing (MindSpeed MM's default is 1024; the data config reader applies it).
    """

    def __init__(
        self,
        processor: Any,
        template: MindSpeedTemplate,
        *,
        train_on_prompt: bool = False,
        mask_history: bool = False,
        enable_thinking: bool = True,
        image_min_pixels: int = 32 * 32,
        image_max_pixels: int = 768 * 768,
        cutoff_len: int | None = None,
        video_processor: QwenVideoProcessor | None = None,
        video_fps: float = 2.0,
        video_maxlen: int = 128,
        video_max_pixels: int = 256 * 256,
        video_min_pixels: int = 16 * 16,
    ) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.template = template
        self.train_on_prompt = train_on_prompt
        self.mask_history = mask_history
        self.enable_thinking = enable_thinking
        self.image_min_pixels = int(image_min_pixels)
        self.image_max_pixels = int(image_max_pixels)
        self.cutoff_len = cutoff_len
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(template.image_token)
        self.video_processor = video_processor
        self.video_fps = float(video_fps)
        self.video_maxlen = int(video_maxlen)
        self.video_max_pixels = int(video_max_pixels)
        self.video_min_pixels = int(video_min_pixels)
        self.video_token_id = self.tokenizer.convert_tokens_to_ids(template.video_token)
        if self.tokenizer.eos_token_id is None and template.efficient_eos:
            raise ConfigError("the tokenizer has no EOS token, which the template's labels need")

    # ------------------------------------------------------------------------------------------ images
    def bound_image(self, image: Any) -> Any:
        """The plugin's ``_preprocess_image``: an area-preserving resize into ``[image_min_pixels,
        image_max_pixels]`` (NEAREST for ``Qwen2VLPlugin``, PIL's default otherwise), RGB, then at least 28
        pixels a side and an aspect ratio of at most 200 (``Qwen2VLPlugin`` and the plugins derived from it)."""
        return _bound(image, self.image_max_pixels, self.image_min_pixels, self.template.nearest)

    def bound_frame(self, image: Any) -> Any:
        """A video frame: ``_preprocess_image`` with the video bounds, NEAREST for every plugin (their
        ``_regularize_videos`` leave ``resample`` at its default)."""
        return _bound(image, self.video_max_pixels, self.video_min_pixels, True)

    def video_inputs(self, paths: Sequence[Any]) -> tuple[dict[str, Any], list[VideoLayout]]:
        """The videos' tensors (``pixel_values_videos``, ``video_grid_thw`` and the model's seconds per temporal
        patch) and each video's :class:`VideoLayout` (its grid and, for ``Qwen3VLPlugin``, its timestamps)."""
        import torch

        from lightning_mm.hf.video_frames import decode_video

        t = self.template
        if t.video is None or self.video_processor is None:
            raise ConfigError(
                f"videos are not supported here with this template ({t.no_video or 'no video processor'})"
            )
        decoded = [decode_video(p, self.video_fps, self.video_maxlen) for p in paths]
        frames = [[self.bound_frame(f) for f in d.frames] for d in decoded]
        out = self.video_processor(frames, metadata_fps=self.metadata_fps)
        kept = out.pop("frames_indices")
        temporal = int(getattr(self.processor.image_processor, "temporal_patch_size", 2))
        seconds = [temporal / d.fps for d in decoded]
        if t.video == "qwen2_omni":
            out["video_second_per_grid"] = torch.tensor(seconds)
        elif t.video == "qwen2_vl" and "second_per_grid_ts" in self.processor.model_input_names:
            out["second_per_grid_ts"] = torch.tensor(seconds)
        grids = [(int(g[0]), int(g[1]), int(g[2])) for g in out["video_grid_thw"]]
        return out, [self.video_layout(grid, indices) for grid, indices in zip(grids, kept)]

    @property
    def metadata_fps(self) -> float | None:
        """The frame rate the plugin hands the video processor's ``sample_frames`` (``Qwen3VLPlugin``: ``video_fps``;
        the others none)."""
        return self.video_fps if self.template.video == "qwen3_vl" else None

    def video_layout(self, grid: tuple[int, int, int], kept: Sequence[int]) -> VideoLayout:
        """A video's layout from its grid and the frame indices the video processor kept: for ``Qwen3VLPlugin``
        the timestamps per temporal patch (the processor's ``_calculate_timestamps(frames_indices, video_fps,
        merge_size)``: the mean time of each group of ``merge_size`` frames, the last index repeated to fill)."""
        if self.template.video != "qwen3_vl" or self.video_processor is None:
            return VideoLayout(grid)
        group = self.video_processor.merge_size
        indices = list(kept) + [kept[-1]] * (-len(kept) % group)
        times = [i / self.video_fps for i in indices]
        return VideoLayout(grid, tuple((times[i] + times[i + group - 1]) / 2 for i in range(0, len(times), group)))

    def vision_inputs(self, images: list[Any]) -> dict[str, Any]:
        """The image processor's tensors of the bounded images, with its own settings."""
        return dict(self.processor.image_processor([self.bound_image(i) for i in images], return_tensors="pt"))

    def image_token_counts(self, grids: Any) -> list[int]:
        """Each image's number of image tokens from its grid (``image_grid_thw``): ``grid.prod() // merge_size**2``
        (the plugins' ``process_messages``)."""
        merge = int(self.processor.image_processor.merge_size) ** 2
        return [int(grid.prod()) // merge for grid in grids]

    def _expand(self, contents: list[str], counts: Sequence[int]) -> list[str]:
        """Each ``<image>`` in turn becomes the vision markers around ``counts[i]`` image tokens."""
        out, index = [], 0
        t = self.template
        for content in contents:
            while _IMAGE in content:
                count = counts[index]
                content = content.replace(_IMAGE, f"{t.vision_bos}{t.image_token * count}{t.vision_eos}", 1)
                index += 1
            out.append(content)
        return out

    def video_token_count(self, layout: VideoLayout) -> int:
        """A video's number of video tokens: ``grid.prod() // merge**2``."""
        t_, h, w = layout.grid
        if self.template.video == "qwen3_vl":
            assert self.video_processor is not None
            return t_ * (h * w // self.video_processor.merge_size**2)
        return t_ * h * w // int(self.processor.image_processor.merge_size) ** 2

    def _expand_videos(self, contents: list[str], layouts: Sequence[VideoLayout]) -> list[str]:
        """The plugin's ``process_messages`` for ``<video>``: Qwen2-VL and Qwen2.5-Omni one run of
        ``grid.prod() // merge**2`` video tokens; Qwen3-VL ``<t seconds>`` and ``h * w // merge**2`` tokens per
        temporal patch (each video its own frame count and timestamps: see docs/data.md)."""
        t = self.template
        out, index = [], 0
        for content in contents:
            while _VIDEO in content:
                layout = layouts[index]
                frames = layout.grid[0]
                if t.video == "qwen3_vl":
                    run = f"{t.vision_bos}{t.video_token * (self.video_token_count(layout) // frames)}{t.vision_eos}"
                    text = "".join(f"<{layout.stamps[f]:.1f} seconds>{run}" for f in range(frames))
                else:
                    text = f"{t.vision_bos}{t.video_token * self.video_token_count(layout)}{t.vision_eos}"
                content = content.replace(_VIDEO, text, 1)
                index += 1
            out.append(content)
        return out

    # ------------------------------------------------------------------------------------------ tokens
    def _ids(self, *elements: str) -> list[int]:
        ids: list[int] = []
        for element in elements:
            if element:
                ids += self.tokenizer.encode(element, add_special_tokens=False)
        return ids

    def encode_pairs(self, contents: list[str], system: str | None) -> list[tuple[list[int], list[int]]]:
        """``Template._encode`` (and ``ReasoningTemplate.encode_multiturn``): (prompt ids, answer ids) per turn."""
        t = self.template
        system = system or t.default_system
        reasoning = t.reasoning
        if reasoning and self.enable_thinking is False:
            contents = [c if i % 2 == 0 else self._remove_thought(c) for i, c in enumerate(contents)]
        encoded = []
        for i, content in enumerate(contents):
            first = (t.prefix, t.system.replace("{{content}}", system, 1) if system else "") if i == 0 else ()
            slot = t.user if i % 2 == 0 else t.assistant
            encoded.append(self._ids(*first, slot.replace("{{content}}", content, 1)))
        if reasoning:
            thought = self._ids(f"{t.thought[0]}\n\n{t.thought[1]}\n\n")
            for i in range(0, len(contents), 2):
                if t.thought[0] not in contents[i + 1] and t.thought[1] not in contents[i + 1]:
                    if not self.enable_thinking:
                        encoded[i] = encoded[i] + thought
                    else:
                        encoded[i + 1] = thought + encoded[i + 1]
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

    def _remove_thought(self, content: str) -> str:
        open_, close = self.template.thought
        return re.sub(f"{re.escape(open_)}(.*?){re.escape(close)}", "", content, flags=re.DOTALL).lstrip("\n")

    def ids_and_labels(self, pairs: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
        """``SupervisedDatasetProcessor._encode_data_example``: each pair cut by ``infer_seqlen``, labelled."""
        eos = self.tokenizer.eos_token_id
        efficient = self.template.efficient_eos
        cutoff = self.cutoff_len
        input_ids: list[int] = []
        labels: list[int] = []
        total = 1 if efficient else 0
        ordered = pairs[::-1] if self.mask_history else pairs
        for turn, (source, target) in enumerate(ordered):
            if cutoff is not None:
                if total >= cutoff:
                    break
                source_len, target_len = infer_seqlen(len(source), len(target), cutoff - total)
                source, target = source[:source_len], target[:target_len]
                total += source_len + target_len
            if self.train_on_prompt:
                source_label = list(source)
            elif efficient:
                source_label = ([eos] + [_IGNORE] * (len(source) - 1)) if source else []
            else:
                source_label = [_IGNORE] * len(source)
            target_label = [_IGNORE] * len(target) if self.mask_history and turn != 0 else list(target)
            if self.mask_history:
                input_ids = source + target + input_ids
                labels = source_label + target_label + labels
            else:
                input_ids += source + target
                labels += source_label + target_label
        if efficient:
            input_ids.append(eos)
            labels.append(eos)
        return input_ids, labels

    # ------------------------------------------------------------------------------------------ samples
    def tokens(
        self,
        messages: Sequence[dict[str, str]],
        system: str | None,
        counts: Sequence[int],
        videos: Sequence[VideoLayout] = (),
    ) -> tuple[list[int], list[int]]:
        """The sample's input ids and labels when its images have ``counts`` image tokens and its videos the
        ``videos`` layouts (no pixel needed); :class:`~lightning_mm.hf.chat_samples.SampleError` when the cut
        splits the images' or videos' tokens or leaves no trained token."""
        from lightning_mm.hf.chat_samples import SampleError

        contents = [m["content"] for m in messages]
        if counts:
            contents = self._expand(contents, counts)
        if videos:
            contents = self._expand_videos(contents, videos)
        input_ids, labels = self.ids_and_labels(self.encode_pairs(contents, system))
        if counts:
            expected = sum(counts)
            found = sum(1 for i in input_ids if i == self.image_token_id)
            if found != expected:
                raise SampleError(
                    f"cutoff_len {self.cutoff_len} cuts the sample through its images' tokens ({found} of {expected} "
                    "kept): raise cutoff_len or shrink the images (image_max_pixels)"
                )
        if videos:
            expected = sum(self.video_token_count(layout) for layout in videos)
            found = sum(1 for i in input_ids if i == self.video_token_id)
            if found != expected:
                raise SampleError(
                    f"cutoff_len {self.cutoff_len} cuts the sample through its videos' tokens ({found} of {expected} "
                    "kept): raise cutoff_len or shrink the videos (video_max_pixels, video_maxlen)"
                )
        if all(label == _IGNORE for label in labels):
            n = len(input_ids)
            raise SampleError(f"the sample cut to cutoff_len {self.cutoff_len} ({n} tokens) has no trained token left")
        return input_ids, labels

    def __call__(
        self,
        messages: Sequence[dict[str, str]],
        system: str | None,
        images: list[Any],
        videos: Sequence[Any] = (),
    ) -> dict[str, Any]:
        """The sample; ``videos`` are video file paths, one per ``<video>``."""
        import torch

        vision = self.vision_inputs(images) if images else {}
        counts = self.image_token_counts(vision["image_grid_thw"]) if images else []
        layouts: list[VideoLayout] = []
        if videos:
            video, layouts = self.video_inputs(videos)
            vision.update(video)
        input_ids, labels = self.tokens(messages, system, counts, layouts)
        n = len(input_ids)
        sample: dict[str, Any] = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "attention_mask": torch.ones(n, dtype=torch.long),
        }
        if getattr(self.processor, "return_mm_token_type_ids", False):
            types = self.processor.create_mm_token_type_ids([input_ids])[0]
            sample["mm_token_type_ids"] = torch.tensor(types, dtype=torch.long)
        sample.update(vision)
        sample["labels"] = torch.tensor(labels, dtype=torch.long)
        return sample

    def filler(self) -> dict[str, Any]:
        """MindSpeed MM's stand-in image of a batch without images (its collator): one 64x64 white image, its
        tokens (the expanded ``<image>``, encoded alone) and pixels."""
        import torch
        from PIL import Image

        vision = self.vision_inputs([Image.new("RGB", (64, 64), (255, 255, 255))])
        ids = self._ids(self._expand([_IMAGE], self.image_token_counts(vision["image_grid_thw"]))[0])
        out: dict[str, Any] = {"input_ids": torch.tensor(ids, dtype=torch.long)}
        if getattr(self.processor, "return_mm_token_type_ids", False):
            out["mm_token_type_ids"] = torch.tensor(self.processor.create_mm_token_type_ids([ids])[0])
        out.update(vision)
        return out


def _bound(image: Any, max_pixels: int, min_pixels: int, nearest: bool) -> Any:
    """``MMPluginMixin._preprocess_image`` then ``Qwen2VLPlugin._preprocess_image`` (see ``bound_image``)."""
    from PIL import Image

    resample = {"resample": Image.Resampling.NEAREST} if nearest else {}
    for limit, beyond in ((max_pixels, 1), (min_pixels, -1)):
        area = image.width * image.height
        if (area - limit) * beyond > 0:
            factor = math.sqrt(limit / area)
            image = image.resize((int(image.width * factor), int(image.height * factor)), **resample)
    if image.mode != "RGB":
        image = image.convert("RGB")
    if min(image.width, image.height) < 28:
        image = image.resize((max(image.width, 28), max(image.height, 28)))
    if image.width / image.height > 200:
        image = image.resize((image.height * 180, image.height))
    if image.height / image.width > 200:
        image = image.resize((image.width, image.width * 180))
    return image
