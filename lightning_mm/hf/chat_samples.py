"""Training samples of a conversation with images, built by the model's own processor and chat template.

The semantics are MindSpeed MM's ``huggingface`` dataset (``mindspeed_mm/data/data_utils/func_utils/template.py``,
``mm_plugin.py``, ``convert.py``): ``<image>`` placeholders in the user turns stand for the record's images in order;
labels cover each assistant turn's content and its end-of-turn tokens (``<|im_end|>\\n`` for the Qwen templates),
the prompt turns too with ``train_on_prompt``, and only the last assistant turn with ``mask_history``.

How it is built here: the conversation is rendered by the processor's chat template (each ``<image>`` becomes an
image part of the message, so the template writes the model's own vision tokens), the processor expands the image
tokens to the model's count and returns the vision tensors, and the trained character spans are found by rendering
the conversation turn by turn (the text up to each assistant turn, with the generation prompt, is a prefix of the
text that includes it). A token is trained when it starts inside a trained span.

The MindSpeed ``template`` name is checked against the model family and selects what differs between its templates
(:data:`TEMPLATES`): ``qwen3_vl`` adds an empty thought (``<think>\\n\\n</think>\\n\\n``) to each assistant turn that
has none, trained with ``enable_thinking`` (the default) and part of the prompt without it (then existing thoughts
are removed, as MindSpeed does); ``qwen3_vl_nothink`` and ``qwen2vl`` add nothing. Default system prompts come from
the model's chat template (Qwen2.5-VL's is MindSpeed's ``qwen2vl`` default, "You are a helpful assistant.").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TEMPLATES", "MINDSPEED_TEMPLATES", "TemplateSpec", "ChatSampleBuilder", "SampleError",
           "IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "IGNORE_INDEX", "template_for"]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
IGNORE_INDEX = -100
_THOUGHT = ("<think>", "</think>")


class SampleError(ValueError):
    """One record cannot be turned into a sample (the message says why)."""


@dataclass(frozen=True)
class TemplateSpec:
    """What a MindSpeed MM template name means for a model family here."""

    model_types: tuple[str, ...]
    collate_names: tuple[str, ...]
    reasoning: bool = False
    """Empty thoughts are added to assistant turns (MindSpeed's ``ReasoningTemplate``)."""


_QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")

TEMPLATES: dict[str, TemplateSpec] = {
    "qwen2vl": TemplateSpec(("qwen2_vl", "qwen2_5_vl"), ("qwen2vl",)),
    "qwen3_vl": TemplateSpec(_QWEN3_VL_TYPES, ("qwen3vl", "qwen2vl"), reasoning=True),
    "qwen3_vl_nothink": TemplateSpec(_QWEN3_VL_TYPES, ("qwen3vl", "qwen2vl")),
}
"""The MindSpeed MM template names supported here. Qwen3.5 / Qwen3.6 (``qwen3_5``, ``qwen3_5_moe``: Transformers'
Qwen3VLProcessor and Qwen3-VL's chat tokens) use the Qwen3-VL templates, as MindSpeed MM's configs for them do."""

MINDSPEED_TEMPLATES = ("qwen2vl", "qwen3_vl", "qwen3_vl_nothink", "qwen2_omni", "qwen3_omni", "qwen3_omni_nothink",
                       "glm4.1v", "glm4v_moe", "mistral", "default")
"""Every template name MindSpeed MM's ``template.py`` registers."""


def template_for(name: Any, model_type: str | None) -> TemplateSpec:
    """The spec of template ``name`` for a model of ``model_type``; ValueError (short, naming both) otherwise.

    ``None`` (MindSpeed MM's FSDP trainer allows it, and ignores the name when a ``chat_template`` file is given)
    is the model's chat template as it is, with nothing added: the spec of the family's non-reasoning template.
    """
    supported = ", ".join(TEMPLATES)
    if name is None:
        for spec in TEMPLATES.values():
            if model_type in spec.model_types and not spec.reasoning:
                return spec
        raise ValueError(f"no template is built in here for {model_type!r} models; supported: {supported}")
    if name not in TEMPLATES:
        known = "a MindSpeed MM template for a family not built in here" if name in MINDSPEED_TEMPLATES else \
            "not a MindSpeed MM template"
        raise ValueError(f"template {name!r} is {known}; supported: {supported}")
    spec = TEMPLATES[name]
    if model_type not in spec.model_types:
        fits = [t for t, s in TEMPLATES.items() if model_type in s.model_types]
        hint = f" (for {model_type} use {', '.join(fits)})" if fits else f"; supported templates: {supported}"
        raise ValueError(f"template {name!r} is for {', '.join(spec.model_types)} models, but the model is "
                         f"{model_type!r}{hint}")
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
    ``image_min_pixels`` / ``image_max_pixels`` go to the image processor as its ``size`` (``shortest_edge`` /
    ``longest_edge``, Transformers' names for the pixel bounds of Qwen's dynamic resolution). ``chat_template``
    (a Jinja text) replaces the processor's own. A sample longer than ``cutoff_len`` tokens is cut at its end when no
    vision token lies past the cut (MindSpeed MM cuts each turn's prompt and answer in proportion instead; a cut
    through an image would break the model's image-token count), and is a :class:`SampleError` otherwise.
    """

    def __init__(self, processor: Any, template: TemplateSpec, *, train_on_prompt: bool = False,
                 mask_history: bool = False, enable_thinking: bool = True, image_min_pixels: int = 32 * 32,
                 image_max_pixels: int = 768 * 768, cutoff_len: int | None = None,
                 chat_template: str | None = None) -> None:
        self.processor = processor
        self.cutoff_len = cutoff_len
        self.chat_template = chat_template
        self.template = template
        self.train_on_prompt = train_on_prompt
        self.mask_history = mask_history
        self.enable_thinking = enable_thinking
        # Transformers refuses a zero shortest_edge; the processor's resize never goes below one patch grid cell.
        self.images_kwargs = {"size": {"shortest_edge": max(int(image_min_pixels), 1),
                                       "longest_edge": int(image_max_pixels)}}
        tokenizer = processor.tokenizer
        self.tokenizer = tokenizer
        self.image_token_id = getattr(processor, "image_token_id", None)
        self.merge = getattr(processor.image_processor, "merge_size", 1)

    # ------------------------------------------------------------------------------------------ rendering
    def conversation(self, messages: Sequence[dict[str, str]], system: str | None
                     ) -> tuple[list[dict[str, Any]], list[int]]:
        """The chat-template conversation and, per assistant message, how many leading characters of its content
        are prompt (the empty thought when thinking is off)."""
        conv: list[dict[str, Any]] = []
        if system:
            conv.append({"role": "system", "content": system})
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
            conv.append({"role": "assistant", "content": content})
            untrained_prefix.append(prefix)
        return conv, untrained_prefix

    def _render(self, conv: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        extra = {} if self.chat_template is None else {"chat_template": self.chat_template}
        return self.processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **extra)

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
                raise SampleError("the model's chat template does not render the conversation turn by turn (the "
                                  "text up to an assistant turn is not a prefix of the whole), so its labels "
                                  "cannot be placed")
            start = len(before) + untrained_prefix[turn]
            last = turn == len(assistant) - 1
            spans.append((cursor, start, self.train_on_prompt))
            spans.append((start, len(upto), not self.mask_history or last))
            cursor = len(upto)
        spans.append((cursor, len(text), self.train_on_prompt))
        return text, [s for s in spans if s[1] > s[0]]

    # ------------------------------------------------------------------------------------------ samples
    def __call__(self, messages: Sequence[dict[str, str]], system: str | None, images: list[Any]) -> dict[str, Any]:
        conv, untrained_prefix = self.conversation(messages, system)
        text, spans = self.trained_spans(conv, untrained_prefix)
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        if images:
            kwargs["images"] = images
            kwargs["images_kwargs"] = self.images_kwargs
        out = self.processor(**kwargs)
        sample = {k: v[0] if k in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids") else v
                  for k, v in out.items()}
        sample["labels"] = self._labels(text, spans, sample["input_ids"], out.get("image_grid_thw"))
        if self.cutoff_len is not None and len(sample["input_ids"]) > self.cutoff_len:
            sample = self._cut(sample)
        return sample

    def _cut(self, sample: dict[str, Any]) -> dict[str, Any]:
        n, cut = len(sample["input_ids"]), self.cutoff_len
        assert cut is not None
        vision = sample.get("mm_token_type_ids")
        beyond = vision[cut:].any() if vision is not None else (sample["input_ids"][cut:] == self.image_token_id).any()
        if bool(beyond):
            raise SampleError(f"the sample has {n} tokens, more than cutoff_len {cut}, and the cut would split its "
                              "images' tokens")
        out = {k: v[:cut] if k in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "labels")
               else v for k, v in sample.items()}
        if not (out["labels"] != IGNORE_INDEX).any():
            raise SampleError(f"the sample has {n} tokens; cut to cutoff_len {cut}, no trained token is left")
        return out

    def filler(self) -> dict[str, Any]:
        """The tokens and pixels of one 64x64 white image (MindSpeed MM's stand-in for a batch without images)."""
        from PIL import Image

        out = self.processor(text=[self.processor.image_token], images=[Image.new("RGB", (64, 64), (255, 255, 255))],
                             images_kwargs=self.images_kwargs, return_tensors="pt")
        return {k: v[0] if k in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids") else v
                for k, v in out.items()}

    def _labels(self, text: str, spans: list[tuple[int, int, bool]], input_ids: Any, grid: Any) -> Any:
        import torch

        encoded = self.tokenizer(text, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        counts = [] if grid is None else (grid.prod(-1) // (self.merge**2)).tolist()
        labels: list[int] = []
        expanded: list[int] = []
        image = 0
        span = 0
        for token, (start, _end) in zip(ids, offsets):
            while span < len(spans) - 1 and start >= spans[span][1]:
                span += 1
            trained = spans[span][2]
            repeat = 1
            if token == self.image_token_id and image < len(counts):
                repeat = counts[image]
                image += 1
            expanded.extend([token] * repeat)
            labels.extend([token if trained else IGNORE_INDEX] * repeat)
        if expanded != input_ids.tolist():
            raise SampleError("the processor's tokens differ from the rendered text's tokens with the image tokens "
                              "expanded; the labels cannot be aligned")
        return torch.tensor(labels, dtype=torch.long)
