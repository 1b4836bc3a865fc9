"""Tiny random vision-language model directories, as a Hub checkpoint lays them out (examples' stand-ins, tests).

Families (:data:`FAMILIES`): ``qwen2_5_vl``, ``qwen3_vl`` and ``llava`` (LLaVA-1.5: ``<s>``, ``</s>``, ``<image>``,
a CLIP tower on 28x28 images giving 4 image tokens, saved by ``LlavaProcessor.save_pretrained``, which loads with
``AutoProcessor`` even without torchvision). The Qwen processors cannot be built by Transformers 5 without
torchvision (their video processor needs it), so their parts are saved one by one.

:func:`write_tiny_vlm` writes ``config.json`` and weights (``save_pretrained``), a byte-level BPE tokenizer built
with the ``tokenizers`` library that holds the family's real special tokens (``<|im_start|>``, ``<|im_end|>``,
``<|vision_start|>``, ``<|image_pad|>``, ...), the image processor of the family (Transformers' PIL one, with a
small patch grid) and a chat template that reproduces the family's real one for system, user and assistant turns
(the tool-calling branches of the real templates are left out). The tokenizer's vocabulary is small (about 400
ids) and the model's ``vocab_size`` matches it, so the ids of the special tokens are real ids of the model.

No network: everything is generated here. ``processor_config.json`` names the processor class, as Transformers'
``save_pretrained`` of the processor would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "QWEN2_5_VL_CHAT_TEMPLATE", "QWEN3_VL_CHAT_TEMPLATE", "LLAVA_CHAT_TEMPLATE", "write_tiny_vlm"]

# The real Qwen2-VL / Qwen2.5-VL chat template (chat_template.json of Qwen/Qwen2.5-VL-7B-Instruct).
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The real Qwen3-VL Instruct chat template (Qwen/Qwen3-VL-8B-Instruct), without its tool-calling branches.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}{%- else %}"
    "{%- for content in messages[0].content %}{%- if 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for content_item in message.content %}"
    "{%- if 'text' in content_item %}{{- content_item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The real LLaVA-1.5 chat template (chat_template.json of llava-hf/llava-1.5-7b-hf).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
_LLAVA_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]

_QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
_CORPUS = [
    "You are a helpful assistant. What is in this picture? Describe the image. A red square on a blue ground.",
    "user assistant system The answer is yes. No, it is not. Two cats and one dog. Think step by step.",
    "<think> </think> Hello world! How many? 0 1 2 3 4 5 6 7 8 9 shapes colours left right top bottom.",
]

# family -> (model class, processor class, image processor settings, chat template, extra special tokens)
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(
        model="Qwen2_5_VLForConditionalGeneration",
        processor="Qwen2_5_VLProcessor",
        image=dict(
            patch_size=14,
            merge_size=2,
            temporal_patch_size=2,
            image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
        ),
        chat_template=QWEN2_5_VL_CHAT_TEMPLATE,
        special=[],
    ),
    "qwen3_vl": dict(
        model="Qwen3VLForConditionalGeneration",
        processor="Qwen3VLProcessor",
        image=dict(
            patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
        ),
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
        special=["<think>", "</think>"],
    ),
    # CLIP tower on 28x28 images, 14x14 patches: 4 image tokens (the CLS feature is dropped, strategy "default").
    "llava": dict(
        model="LlavaForConditionalGeneration",
        processor="LlavaProcessor",
        image={},
        chat_template=LLAVA_CHAT_TEMPLATE,
        special=[],
    ),
}


def _tokenizer(special: list[str], llava: bool = False) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokens = _LLAVA_SPECIAL if llava else [*_QWEN_SPECIAL, *special]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=tokens, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    if llava:
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            extra_special_tokens={"image_token": "<image>"},
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _config(family: str, tokenizer: Any, init_std: float) -> Any:
    import transformers

    if family == "llava":
        text = dict(
            _TEXT,
            model_type="llama",
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            initializer_range=init_std,
        )
        vision = dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=28,
            patch_size=14,
            projection_dim=32,
        )
        # LlavaConfig takes these through PretrainedConfig's **kwargs, which its annotations leave out
        config = transformers.LlavaConfig(  # type: ignore[call-arg]
            text_config=text,
            vision_config=vision,
            initializer_range=init_std,
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        )
        config.architectures = [FAMILIES[family]["model"]]
        return config

    ids: dict[str, Any] = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    text = dict(
        _TEXT,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        initializer_range=init_std,
    )
    cls: Any  # the Qwen-VL config class of the family
    if family == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLConfig
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=32,
            fullatt_block_indexes=[1],
            window_size=56,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
    else:
        cls = transformers.Qwen3VLConfig
        text.update(
            head_dim=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [1, 1, 2],
                "mrope_interleaved": True,
            },
        )
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=32,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        )
    vision["initializer_range"] = init_std
    config = cls(text_config=text, vision_config=vision, **ids, tie_word_embeddings=False, initializer_range=init_std)
    config.architectures = [FAMILIES[family]["model"]]
    return config


def write_tiny_vlm(
    directory: str | Path,
    family: str = "qwen2_5_vl",
    seed: int = 0,
    min_pixels: int = 28 * 28,
    max_pixels: int = 112 * 112,
    init_std: float = 0.02,
) -> Path:
    """Write a tiny random ``family`` model directory (see the module docstring) into ``directory``.

    ``init_std`` is the weights' initialiser range: larger than Transformers' 0.02 makes attention depend visibly
    on positions (at 0.02 the tiny model's attention is nearly uniform, so wrong M-RoPE positions barely show).
    """
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = FAMILIES[family]
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    llava = family == "llava"
    tokenizer = _tokenizer(spec["special"], llava=llava)
    if llava:
        from transformers import LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        image = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        LlavaProcessor(
            image_processor=image,
            tokenizer=tokenizer,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=spec["chat_template"],
        ).save_pretrained(path)
    else:
        tokenizer.save_pretrained(path)
        config_file = path / "tokenizer_config.json"
        tok_config = json.loads(config_file.read_text())
        tok_config["tokenizer_class"] = "Qwen2Tokenizer"
        config_file.write_text(json.dumps(tok_config, indent=1))
        Qwen2VLImageProcessorPil(**spec["image"], min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(path)
        (path / "chat_template.jinja").write_text(spec["chat_template"])
        (path / "processor_config.json").write_text(json.dumps({"processor_class": spec["processor"]}, indent=1))
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model"])(_config(family, tokenizer, init_std))
    model.save_pretrained(path)
    return path
