"""A tiny InternVL model directory in Transformers' format, built locally (no hub).

``build_tiny_internvl(directory)`` writes what a converted InternVL checkpoint holds (``OpenGVLab/InternVL3-1B-hf``
and its kind): ``config.json`` + weights of a random ``InternVLForConditionalGeneration`` (a 2-layer vision
tower and a Qwen2 text model), a byte-level BPE tokenizer built with ``tokenizers`` holding InternVL's special
tokens (``<|im_start|>``, ``<|im_end|>``, ``<img>``, ``</img>``, ``<IMG_CONTEXT>``, ``<quad>`` ... ``<video>``) and
the named tokens InternVL's processor reads, a ``GotOcr2ImageProcessor`` config (PIL backend), the processor config
and InternVL's Hugging Face chat template (the one of Transformers' conversion script).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TILE = 56
"""Tile side in pixels: 4x4 patches of 14, 4 image tokens per tile after the 0.5 pixel shuffle."""
PATCH = 14
TOKENS_PER_TILE = int((TILE // PATCH) ** 2 * 0.5**2)
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<video>",
]
NAMED_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

HF_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}"
    "{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{'<|im_end|>\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{'<|im_start|>assistant\n' }}"
    "{% endif %}"
)
"""InternVL's chat template as Transformers' ``convert_internvl_weights_to_hf.py`` writes it."""


@dataclass(frozen=True)
class TinyInternVL:
    directory: Path
    vocab_size: int
    image_token_id: int
    pad_id: int


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("a", "t"), ("Ġ", "c"), ("Ġc", "at"), ("s", "s"), ("a", "ss")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=dict(NAMED_TOKENS),
    )


def build_tiny_internvl(directory: Path, seed: int = 0, max_patches: int = 12) -> TinyInternVL:
    """Write the tiny InternVL model directory into ``directory`` (created)."""
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig, InternVLForConditionalGeneration

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.chat_template = HF_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    vocab_size = (len(tokenizer) + 7) // 8 * 8
    image_token_id = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE},
        image_mean=MEAN,
        image_std=STD,
        crop_to_patches=False,
        min_patches=1,
        max_patches=max_patches,
    ).save_pretrained(directory)
    (directory / "processor_config.json").write_text(
        json.dumps({"processor_class": "InternVLProcessor", "image_seq_length": TOKENS_PER_TILE}, indent=2)
    )
    (directory / "chat_template.jinja").write_text(HF_CHAT_TEMPLATE)
    text = dict(
        model_type="qwen2",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=[TILE, TILE],
        patch_size=[PATCH, PATCH],
    )
    config = InternVLConfig(text_config=text, vision_config=vision, image_token_id=image_token_id, downsample_ratio=0.5)
    config.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(seed)
    InternVLForConditionalGeneration(config).save_pretrained(directory)
    return TinyInternVL(directory, vocab_size, image_token_id, pad_id)
