"""Training samples of a conversation with images, built by the model's own processor and chat template.

MindSpeed MM's named templates (``template: qwen2vl``, ``qwen3_vl``, ...) are built as MindSpeed MM builds them, by
:class:`~lightning_mm.hf.mindspeed_samples.MindSpeedSampleBuilder`. This module holds the template names (checked
against the model family: :data:`TEMPLATES`, :func:`template_for`) and :class:`ChatSampleBuilder`, which renders a
conversation with the model's OWN chat template: for ``template: null`` (Gemma 3, Idefics3, which MindSpeed MM has
no template for: :data:`OWN_TEMPLATE_FAMILIES`; or any family, its chat template as it is) and for a
``chat_template`` file. MindSpeed MM's FSDP route parses such a chat template into slots with its ``BasePlugin``,
which expands no image placeholder, so images cannot train that way there; here the model's processor expands them.

The semantics follow MindSpeed MM's ``huggingface`` dataset (``mindspeed_mm/fsdp/data/data_utils/func_utils/
template.py``, ``mm_plugin.py``, ``convert.py``): ``<image>`` placeholders in the user turns stand for the record's
images in order; images are bounded as its ``BasePlugin`` bounds them (a NEAREST area-preserving resize into
``image_min_pixels`` / ``image_max_pixels``) and the processor then runs with its own settings; labels cover each
assistant turn's content and its end-of-turn tokens, the prompt turns too with ``train_on_prompt``, and only the last
assistant turn with ``mask_history``.

How it is built here: the conversation is rendered by the processor's chat template (each ``<image>`` becomes an
image part of the message, so the template writes the model's own vision tokens), the processor expands the
placeholders to each image's token count and returns the vision tensors, as the model's own
``apply_chat_template(tokenize=True)`` calls it (no second BOS when the template writes one), and the trained
character spans are found by rendering the conversation turn by turn (the text up to each assistant turn, with the
generation prompt, is a prefix of the text that includes it). They are moved past the placeholders the processor
expanded before them (its ``text_replacement_offsets``), and a token is trained when its first character (its
offset in the processor's expanded text) lies inside a trained span: any processor that expands placeholders the
Transformers 5 way (``replace_image_token``) fits, whatever its vision tokens look like. A sample longer than
``cutoff_len`` is cut at its end (there is no MindSpeed MM template to cut by turn).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_mm.errors import ConfigError, DataError

__all__ = [
    "TEMPLATES",
    "OWN_TEMPLATE_FAMILIES",
    "MINDSPEED_TEMPLATES",
    "TemplateSpec",
    "ChatSampleBuilder",
    "SampleError",
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "IGNORE_INDEX",
    "template_for",
]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
IGNORE_INDEX = -100
_THOUGHT = ("<think>", "</think>")
_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


class SampleError(DataError):
    """One record cannot be turned into a sample (the message says why)."""


@dataclass(frozen=True)
class TemplateSpec:
    """What a MindSpeed MM template name means for a model family here."""

    model_types: tuple[str, ...]
    collate_names: tuple[str, ...]
    reasoning: bool = False
    """Empty thoughts are added to assistant turns (MindSpeed's ``ReasoningTemplate``)."""
    content_parts: bool = False
    """System and assistant texts go to the chat template as a list of text parts (Idefics3's template reads only
    parts), else as strings (GLM-4V's template writes the content as it is)."""


_QWEN_COLLATE = ("qwen2vl", "qwen3vl")
_QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
TEMPLATES: dict[str, TemplateSpec] = {
    "qwen2vl": TemplateSpec(("qwen2_vl", "qwen2_5_vl"), ("qwen2vl",)),
    "qwen3_vl": TemplateSpec(_QWEN3_VL_TYPES, ("qwen3vl", "qwen2vl"), reasoning=True),
    "qwen3_vl_nothink": TemplateSpec(_QWEN3_VL_TYPES, ("qwen3vl", "qwen2vl")),
    "qwen3_6": TemplateSpec(("qwen3_5", "qwen3_5_moe"), ("qwen3vl", "qwen2vl"), reasoning=True),
    "qwen2_omni": TemplateSpec(("qwen2_5_omni", "qwen2_5_omni_thinker"), (*_QWEN_COLLATE, "qwen3omni")),
    "glm4.1v": TemplateSpec(("glm4v",), ("glm4v_moe", *_QWEN_COLLATE), reasoning=True),
    "glm4v_moe": TemplateSpec(("glm4v_moe",), ("glm4v_moe", *_QWEN_COLLATE), reasoning=True),
}
"""The MindSpeed MM template names supported here. Qwen3.5 / Qwen3.6 (``qwen3_5``, ``qwen3_5_moe``: Transformers'
Qwen3VLProcessor and Qwen3-VL's chat tokens) use the Qwen3-VL templates, as MindSpeed MM's configs for them do."""

OWN_TEMPLATE_FAMILIES: dict[str, TemplateSpec] = {
    "gemma3": TemplateSpec(("gemma3",), _QWEN_COLLATE),
    "idefics3": TemplateSpec(("idefics3",), _QWEN_COLLATE, content_parts=True),
}
"""Families MindSpeed MM registers no template for: their model's own chat template renders the conversations
(``template: null``, or a ``chat_template`` file), nothing added."""

MINDSPEED_TEMPLATES = (
    "qwen2vl",
    "qwen3_vl",
    "qwen3_vl_nothink",
    "qwen3_6",
    "qwen3_6_nothink",
    "step3_vl",
    "qwen2_omni",
    "qwen3_omni",
    "qwen3_omni_nothink",
    "kimi_k25",
    "kimi_k3",
    "qwen3_asr",
    "glm4.1v",
    "glm4v_moe",
    "default",
    "empty",
)
"""Every template name the FSDP2 route of MindSpeed MM registers (``mindspeed_mm/fsdp/data/data_utils/func_utils/
template.py``). ``qwen3_6_nothink`` is text only there (its plugin expands no image placeholder)."""


def template_for(name: Any, model_type: str | None) -> TemplateSpec:
    """The spec of template ``name`` for a model of ``model_type``; ValueError (short, naming both) otherwise.

    ``None`` (MindSpeed MM's FSDP trainer allows it, and ignores the name when a ``chat_template`` file is given)
    is the model's chat template as it is, with nothing added: the spec of the family's non-reasoning template, or
    of a family that has no MindSpeed MM template (:data:`OWN_TEMPLATE_FAMILIES`).
    """
    supported = ", ".join(TEMPLATES)
    own = ", ".join(t for s in OWN_TEMPLATE_FAMILIES.values() for t in s.model_types)
    if name is None:
        for spec in (*TEMPLATES.values(), *OWN_TEMPLATE_FAMILIES.values()):
            if model_type in spec.model_types and not spec.reasoning:
                return spec
        raise ConfigError(
            f"no template is built in here for {model_type!r} models; supported: {supported} (and "
            f"template: null for {own} models)"
        )
    if name not in TEMPLATES:
        known = (
            "a MindSpeed MM template for a family not built in here"
            if name in MINDSPEED_TEMPLATES
            else "not a MindSpeed MM template"
        )
        hint = next(
            (
                f"; a {model_type} model takes template: null (its own chat template)"
                for s in OWN_TEMPLATE_FAMILIES.values()
                if model_type in s.model_types
            ),
            "",
        )
        raise ConfigError(f"template {name!r} is {known}; supported: {supported}{hint}")
    spec = TEMPLATES[name]
    if model_type not in spec.model_types:
        fits = [t for t, s in TEMPLATES.items() if model_type in s.model_types]
        if any(model_type in s.model_types for s in OWN_TEMPLATE_FAMILIES.values()):
            fits.append("null (its own chat template)")
        hint = f" (for {model_type} use {', '.join(fits)})" if fits else f"; supported templates: {supported}"
        raise ConfigError(
            f"template {name!r} is for {', '.join(spec.model_types)} models, but the model is {model_type!r}{hint}"
        )
    return spec


def _remove_thought(content: str) -> str:
    pattern = re.compile(f"{re.escape(_THOUGHT[0])}(.*?){re.escape(_THOUGHT[1])}", re.DOTALL)
    return re.sub(pattern, "", content).lstrip("\n")


def _user_parts(content: str) -> list[dict[str, str]]:
    parts: list[dict[str, str]] = []
    for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


class ChatSampleBuilder:
    """Turns ``(messages, system, images)`` into the keys the model's forward takes, plus ``labels``.

    ``messages`` alternate ``{"role": "user" | "assistant", "content": str}``, user first, assistant last.
    Images are bounded by ``image_min_pixels`` / ``image_max_pixels`` (:meth:`bound_image`), then the processor
    resizes them with its own settings. ``chat_template`` (a Jinja text) replaces the processor's own. A sample
    longer than ``cutoff_len`` tokens is cut at its end when no vision token lies past the cut (a cut through an
    image would break the model's image-token count), and is a :class:`SampleError` otherwise.
    """

    def __init__(
        self,
        processor: Any,
        template: TemplateSpec,
        *,
        train_on_prompt: bool = False,
        mask_history: bool = False,
        enable_thinking: bool = True,
        image_min_pixels: int = 32 * 32,
        image_max_pixels: int = 768 * 768,
        cutoff_len: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.processor = processor
        self.cutoff_len = cutoff_len
        self.chat_template = chat_template
        self.template = template
        self.train_on_prompt = train_on_prompt
        self.mask_history = mask_history
        self.enable_thinking = enable_thinking
        self.image_min_pixels = max(int(image_min_pixels), 0)
        self.image_max_pixels = int(image_max_pixels)
        self.tokenizer = processor.tokenizer

    # ------------------------------------------------------------------------------------------ rendering
    def conversation(
        self, messages: Sequence[dict[str, str]], system: str | None
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """The chat-template conversation and, per assistant message, how many leading characters of its content
        are prompt (the empty thought when thinking is off)."""
        conv: list[dict[str, Any]] = []
        if system:
            conv.append({"role": "system", "content": self._text(system)})
        untrained_prefix: list[int] = []
        empty_thought = f"{_THOUGHT[0]}\n\n{_THOUGHT[1]}\n\n"
        for message in messages:
            content = message["content"]
            if message["role"] == "user":
                conv.append({"role": "user", "content": _user_parts(content)})
                continue
            prefix = 0
            if self.template.reasoning:
                if self.enable_thinking is False:
                    content = _remove_thought(content)
                if _THOUGHT[0] not in content and _THOUGHT[1] not in content:
                    content = empty_thought + content
                    prefix = 0 if self.enable_thinking else len(empty_thought)
            conv.append({"role": "assistant", "content": self._text(content)})
            untrained_prefix.append(prefix)
        return conv, untrained_prefix

    def _text(self, text: str) -> str | list[dict[str, str]]:
        return [{"type": "text", "text": text}] if self.template.content_parts else text

    def _render(self, conv: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        extra = {} if self.chat_template is None else {"chat_template": self.chat_template}
        return self.processor.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=generation_prompt, **extra
        )

    def trained_spans(self, conv: list[dict[str, Any]], untrained_prefix: list[int]) -> tuple[str, list[tuple]]:
        """The rendered text and its ``(start, end, trained)`` character spans covering it."""
        text = self._render(conv)
        assistant = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        spans: list[tuple[int, int, bool]] = []
        cursor = 0
        for turn, index in enumerate(assistant):
            before = self._render(conv[:index], generation_prompt=True)
            upto = self._render(conv[: index + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise SampleError(
                    "the model's chat template does not render the conversation turn by turn (the "
                    "text up to an assistant turn is not a prefix of the whole), so its labels "
                    "cannot be placed"
                )
            start = len(before) + untrained_prefix[turn]
            last = turn == len(assistant) - 1
            spans.append((cursor, start, self.train_on_prompt))
            spans.append((start, len(upto), not self.mask_history or last))
            cursor = len(upto)
        spans.append((cursor, len(text), self.train_on_prompt))
        return text, [s for s in spans if s[1] > s[0]]

    # ------------------------------------------------------------------------------------------ samples
    def bound_image(self, image: Any) -> Any:
        """``image`` within ``image_max_pixels`` / ``image_min_pixels`` as MindSpeed MM's ``BasePlugin`` bounds it
        (``_preprocess_image``: a NEAREST resize keeping the area's bound), in RGB; the processor then resizes it
        with its own settings."""
        from PIL import Image

        for limit, too_far in (
            (self.image_max_pixels, lambda area: area > self.image_max_pixels),
            (self.image_min_pixels, lambda area: area < self.image_min_pixels),
        ):
            area = image.width * image.height
            if too_far(area):
                factor = math.sqrt(limit / area)
                size = (max(int(image.width * factor), 1), max(int(image.height * factor), 1))
                image = image.resize(size, resample=Image.Resampling.NEAREST)
        return image.convert("RGB") if image.mode != "RGB" else image

    def process(self, text: str, images: list[Any]) -> tuple[dict[str, Any], list[tuple[int, int]], list[dict]]:
        """The processor's sample of ``text`` and ``images`` (as the model's ``apply_chat_template(tokenize=True)``
        calls it: no second BOS when the template writes one), each token's character offsets in the expanded
        text, and where the processor expanded each image placeholder."""
        kwargs: dict[str, Any] = {
            "text": [text],
            "return_tensors": "pt",
            "return_offsets_mapping": True,
            "return_text_replacement_offsets": True,
        }
        bos = self.tokenizer.bos_token
        if bos is not None and text.startswith(bos):
            kwargs["add_special_tokens"] = False
        if images:
            kwargs["images"] = [self.bound_image(image) for image in images]
        out = dict(self.processor(**kwargs))
        if "offset_mapping" not in out:
            raise SampleError(
                f"{type(self.processor).__name__} returns no character offsets of its tokens "
                "(return_offsets_mapping), so the labels cannot be placed"
            )
        offsets = [tuple(o) for o in out.pop("offset_mapping")[0].tolist()]
        replacements = list(out.pop("text_replacement_offsets", None) or [[]])[0]
        sample = {k: v[0] if k in _TOKEN_KEYS else v for k, v in out.items()}
        return sample, offsets, replacements

    def __call__(self, messages: Sequence[dict[str, str]], system: str | None, images: list[Any]) -> dict[str, Any]:
        conv, untrained_prefix = self.conversation(messages, system)
        text, spans = self.trained_spans(conv, untrained_prefix)
        sample, offsets, replacements = self.process(text, images)
        if len(replacements) != len(images):
            raise SampleError(
                f"the processor expanded {len(replacements)} image placeholders for {len(images)} "
                "images; the labels cannot be aligned"
            )
        return self.finish(sample, spans, offsets, replacements)

    def finish(
        self,
        sample: dict[str, Any],
        spans: list[tuple[int, int, bool]],
        offsets: list[tuple[int, int]],
        replacements: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """``sample`` (the processor's keys) with its labels, cut to ``cutoff_len`` (:meth:`_cut`)."""
        sample["labels"] = self._labels(spans, sample["input_ids"], offsets, replacements)
        if self.cutoff_len is not None and len(sample["input_ids"]) > self.cutoff_len:
            vision_end = max(
                (
                    i + 1
                    for i, (start, end) in enumerate(offsets)
                    for r in replacements
                    if start < r["new_span"][1] and end > r["new_span"][0]
                ),
                default=0,
            )
            sample = self._cut(sample, vision_end)
        return sample

    def _cut(self, sample: dict[str, Any], vision_end: int) -> dict[str, Any]:
        n, cut = len(sample["input_ids"]), self.cutoff_len
        assert cut is not None
        if vision_end > cut:
            raise SampleError(
                f"the sample has {n} tokens, more than cutoff_len {cut}, and the cut would split its images' tokens"
            )
        out = {k: v[:cut] if k in (*_TOKEN_KEYS, "labels") else v for k, v in sample.items()}
        if not (out["labels"] != IGNORE_INDEX).any():
            raise SampleError(f"the sample has {n} tokens; cut to cutoff_len {cut}, no trained token is left")
        return out

    def filler(self) -> dict[str, Any]:
        """The tokens and pixels of one 64x64 white image (MindSpeed MM's stand-in for a batch without images)."""
        from PIL import Image

        image = self.bound_image(Image.new("RGB", (64, 64), (255, 255, 255)))
        out = self.processor(text=[self.processor.image_token], images=[image], return_tensors="pt")
        return {k: v[0] if k in _TOKEN_KEYS else v for k, v in out.items()}

    def _labels(
        self,
        spans: list[tuple[int, int, bool]],
        input_ids: Any,
        offsets: list[tuple[int, int]],
        replacements: list[dict[str, Any]],
    ) -> Any:
        """Each token trained when its first character lies in a trained span of the rendered text (the spans
        shifted past the image placeholders the processor expanded before them); an image's tokens take the span
        of its placeholder."""
        import torch

        shifted: list[tuple[int, int, bool]] = []
        for start, end, trained in spans:
            shifted.append((self._expanded(start, replacements), self._expanded(end, replacements), trained))
        ids = input_ids.tolist()
        labels: list[int] = []
        span = 0
        for token, (start, end) in zip(ids, offsets):
            if end == start == 0 and labels:  # a special token the tokenizer added at the end (an EOS): prompt
                labels.append(token if self.train_on_prompt else IGNORE_INDEX)
                continue
            while span < len(shifted) - 1 and start >= shifted[span][1]:
                span += 1
            labels.append(token if shifted[span][2] else IGNORE_INDEX)
        return torch.tensor(labels, dtype=torch.long)

    @staticmethod
    def _expanded(char: int, replacements: list[dict[str, Any]]) -> int:
        """Character ``char`` of the rendered text, in the processor's expanded text."""
        shift = 0
        for r in replacements:
            if r["span"][1] <= char:
                shift = r["new_span"][1] - r["span"][1]
        return char + shift
