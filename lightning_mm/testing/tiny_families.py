"""Tiny random model directories of more vision-language families, as a Hub checkpoint lays them out (tests).

Families (:data:`FAMILIES`): ``gemma3`` (Gemma 3: a SigLIP tower, 32x32 images pooled to 4 soft tokens),
``idefics3`` (Idefics3 / SmolVLM: a SigLIP tower, images split into crops plus a global image), ``mistral3``
(Mistral 3 / Magistral: a Pixtral tower, ``[IMG]``/``[IMG_BREAK]``/``[IMG_END]`` rows), ``glm4v`` (GLM-4.1V),
``glm4v_moe`` (GLM-4.5V) and ``qwen2_5_omni_thinker`` (Qwen2.5-Omni's thinker: text and images).

:func:`write_tiny_family` writes ``config.json`` and weights (``save_pretrained``), a byte-level BPE tokenizer built
with the ``tokenizers`` library that holds the family's real special tokens, the family's image processor
(Transformers' PIL one, small sizes) and a chat template that renders system, user and assistant turns as the
family's real one does (the tool-calling branches of the real templates are left out). The processor is saved by
its own ``save_pretrained`` where Transformers can build it without torchvision, else part by part (as
``lightning_mm/testing/tiny_vlms.py`` does for Qwen-VL). The tokenizer's vocabulary is small and the model's
``vocab_size`` matches it, so the ids of the special tokens are real ids of the model. No network: everything is
generated here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "GEMMA3_CHAT_TEMPLATE", "write_tiny_family"]

# The real Gemma 3 chat template (chat_template.json of google/gemma-3-4b-it).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    '{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}'
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}"
    "{%- endif -%}"
)

# The real Idefics3 chat template (HuggingFaceM4/Idefics3-8B-Llama3); SmolVLM's is the same after its own BOS.
IDEFICS3_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# The Mistral Small 3.1 / Magistral chat template (mistralai/Mistral-Small-3.1-24B-Instruct-2503), with a short
# default system prompt in place of the real one's paragraph.
MISTRAL3_CHAT_TEMPLATE = (
    "{%- set default_system_message = 'You are a helpful assistant.' %}{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- if messages[0]['content'] is string %}"
    "{%- set system_message = messages[0]['content'] %}{%- else %}"
    "{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system_message = default_system_message %}"
    "{%- set loop_messages = messages %}{%- endif %}{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{%- if message['content'] is string %}"
    "{{- '[INST]' + message['content'] + '[/INST]' }}{%- else %}{{- '[INST]' }}"
    "{%- for block in message['content'] %}{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}{%- else %}"
    "{{- raise_exception('Only text and image blocks are supported in message content!') }}{%- endif %}"
    "{%- endfor %}{{- '[/INST]' }}{%- endif %}{%- elif message['role'] == 'system' %}"
    "{%- if message['content'] is string %}{{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{%- if message['content'] is string %}"
    "{{- message['content'] + eos_token }}{%- else %}{{- message['content'][0]['text'] + eos_token }}{%- endif %}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}{%- endif %}"
    "{%- endfor %}"
)

# GLM-4.1V's chat template (zai-org/GLM-4.1V-9B-Thinking) for system, user and assistant turns: what MindSpeed MM's
# `glm4.1v` / `glm4v_moe` templates write (`[gMASK]<sop>`, `<|user|>\n...<|assistant|>\n...`, no end-of-turn
# token); GLM-4.5V's real template renders these turns alike.
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}"
    "{%- elif msg.role == 'user' %}<|user|>{{ '\n' }}{%- if msg.content is string %}{{ msg.content }}{%- else %}"
    "{%- for item in msg.content %}{%- if item.type == 'video' or 'video' in item %}"
    "<|begin_of_video|><|video|><|end_of_video|>{%- elif item.type == 'image' or 'image' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- elif msg.role == 'assistant' %}<|assistant|>\n{{ msg.content }}{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_GLM_SPECIAL = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
    "<think>",
    "</think>",
]

# The real Qwen2.5-Omni chat template (Qwen/Qwen2.5-Omni-7B).
QWEN2_5_OMNI_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are Qwen, a virtual human developed by "
    "the Qwen Team, Alibaba Group, capable of perceiving auditory and visual inputs, as well as generating text and "
    "speech.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: "
    "{% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_OMNI_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}

_CORPUS = [
    "You are a helpful assistant. What is in this picture? Describe the image. A red square on a blue ground.",
    "user assistant system model The answer is yes. No, it is not. Two cats and one dog. Think step by step.",
    "Hello world! How many? 0 1 2 3 4 5 6 7 8 9 shapes colours left right top bottom. Be brief.",
]
_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)

FAMILIES: dict[str, dict[str, Any]] = {
    # 32x32 images, 8x8 patches: 16 patches pooled 2x2 to 4 soft tokens per image.
    "gemma3": dict(
        model="Gemma3ForConditionalGeneration",
        processor="Gemma3Processor",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        special=[
            "<bos>",
            "<eos>",
            "<pad>",
            "<unk>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        ],
    ),
    # 32x32 crops, 8x8 patches, pixel shuffle 2: 4 image tokens per crop; images up to 64 pixels are split into
    # 32x32 crops plus a global image.
    "idefics3": dict(
        model="Idefics3ForConditionalGeneration",
        processor="Idefics3Processor",
        chat_template=IDEFICS3_CHAT_TEMPLATE,
        special=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<pad>",
            "<end_of_utterance>",
            "<fake_token_around_image>",
            "<image>",
            "<global-img>",
            *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
        ],
    ),
    # A Pixtral tower with 8x8 patches merged 2x2: one [IMG] per 16x16 pixels, a row of them ended by [IMG_BREAK],
    # the last by [IMG_END]; images up to 64 pixels on their longest edge.
    "mistral3": dict(
        model="Mistral3ForConditionalGeneration",
        processor="PixtralProcessor",
        chat_template=MISTRAL3_CHAT_TEMPLATE,
        special=[
            "<unk>",
            "<s>",
            "</s>",
            "<pad>",
            "[INST]",
            "[/INST]",
            "[IMG]",
            "[IMG_BREAK]",
            "[IMG_END]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
        ],
    ),
    # Qwen-VL-like patches (14 pixels, merged 2x2, two frames per patch), images within 28*28..56*56*2 pixels.
    "glm4v": dict(
        model="Glm4vForConditionalGeneration",
        processor="Glm4vProcessor",
        chat_template=GLM4V_CHAT_TEMPLATE,
        special=_GLM_SPECIAL,
    ),
    # GLM-4.1V's tower and processor; the decoder's second layer is a mixture of 4 experts (top 2) and a shared one.
    "glm4v_moe": dict(
        model="Glm4vMoeForConditionalGeneration",
        processor="Glm4vProcessor",
        chat_template=GLM4V_CHAT_TEMPLATE,
        special=_GLM_SPECIAL,
    ),
    # The thinker alone (text, images; its audio tower is built but the data path takes no audio): Qwen2.5-VL's
    # vision tower and patches.
    "qwen2_5_omni_thinker": dict(
        model="Qwen2_5OmniThinkerForConditionalGeneration",
        processor="Qwen2_5OmniProcessor",
        chat_template=QWEN2_5_OMNI_CHAT_TEMPLATE,
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_OMNI_TOKENS.values()],
    ),
}


def _tokenizer(special: list[str], bos: str | None = None) -> Any:
    """A byte-level BPE tokenizer holding ``special``; it adds ``bos`` in front of a text, as Gemma's and Llama 3's
    (Idefics3's) tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def _gemma3(path: Path, init_std: float) -> Any:
    import transformers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    spec = FAMILIES["gemma3"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(spec["special"], bos="<bos>"),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    image = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    Gemma3Processor(
        image_processor=image, tokenizer=tokenizer, image_seq_length=4, chat_template=spec["chat_template"]
    ).save_pretrained(path)
    ids: dict[str, Any] = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<image_soft_token>"),
            ("boi_token_id", "<start_of_image>"),
            ("eoi_token_id", "<end_of_image>"),
        )
    }
    text = dict(
        _TEXT,
        head_dim=8,
        vocab_size=len(tokenizer),
        sliding_window=16,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        query_pre_attn_scalar=8,
        initializer_range=init_std,
    )
    vision = dict(_SIGLIP, image_size=32, patch_size=8, vision_use_head=False)
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, initializer_range=init_std, **ids
    )


def _idefics3(path: Path, init_std: float) -> Any:
    import transformers
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    spec = FAMILIES["idefics3"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(spec["special"], bos="<|begin_of_text|>"),
        bos_token="<|begin_of_text|>",
        eos_token="<end_of_utterance>",
        pad_token="<pad>",
    )
    image = Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    Idefics3Processor(
        image_processor=image, tokenizer=tokenizer, image_seq_len=4, chat_template=spec["chat_template"]
    ).save_pretrained(path)
    text = dict(
        _TEXT,
        model_type="llama",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=init_std,
    )
    vision = dict(_SIGLIP, image_size=32, patch_size=8, initializer_range=init_std)
    # Idefics3Config takes these through PretrainedConfig's **kwargs, which its annotations leave out
    return transformers.Idefics3Config(  # type: ignore[call-arg]
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=_token_id(tokenizer, "<image>"),
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=init_std,
    )


def _mistral3(path: Path, init_std: float) -> Any:
    import transformers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    spec = FAMILIES["mistral3"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(spec["special"]),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    # Transformers 5's PixtralProcessor cannot be imported without torchvision: saved part by part, its settings
    # in processor_config.json as its save_pretrained writes them.
    tokenizer.save_pretrained(path)
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size={"height": 8, "width": 8}).save_pretrained(path)
    (path / "chat_template.jinja").write_text(spec["chat_template"])
    _write_json(
        path / "processor_config.json",
        {
            "processor_class": spec["processor"],
            "patch_size": 8,
            "spatial_merge_size": 2,
            "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
        },
    )
    text = dict(
        _TEXT,
        model_type="mistral",
        head_dim=8,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=init_std,
        sliding_window=None,
    )
    vision = dict(_SIGLIP, model_type="pixtral", head_dim=8, image_size=64, patch_size=8, initializer_range=init_std)
    return transformers.Mistral3Config(
        text_config=text,
        vision_config=vision,
        spatial_merge_size=2,
        image_token_index=_token_id(tokenizer, "[IMG]"),
        tie_word_embeddings=False,
    )


def _glm4v(path: Path, init_std: float, family: str = "glm4v") -> Any:
    import transformers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    spec = FAMILIES[family]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(spec["special"]), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(path)  # the processor's video processor needs torchvision: saved part by part
    Glm4vImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56 * 2}
    ).save_pretrained(path)
    (path / "chat_template.jinja").write_text(spec["chat_template"])
    _write_json(path / "processor_config.json", {"processor_class": spec["processor"]})
    ids: dict[str, Any] = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image|>"),
            ("video_token_id", "<|video|>"),
            ("image_start_token_id", "<|begin_of_image|>"),
            ("image_end_token_id", "<|end_of_image|>"),
            ("video_start_token_id", "<|begin_of_video|>"),
            ("video_end_token_id", "<|end_of_video|>"),
        )
    }
    text = dict(
        _TEXT,
        num_attention_heads=2,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=init_std,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
            "partial_rotary_factor": 0.5,
        },
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=32,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        image_size=28,
        initializer_range=init_std,
    )
    if family == "glm4v_moe":
        text.update(
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
        )
        return transformers.Glm4vMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return transformers.Glm4vConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def _qwen2_5_omni_thinker(path: Path, init_std: float) -> Any:
    import transformers
    from transformers import PreTrainedTokenizerFast, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = FAMILIES["qwen2_5_omni_thinker"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(spec["special"]),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=dict(_OMNI_TOKENS),
    )
    tokenizer.save_pretrained(path)  # the processor's video processor needs torchvision: saved part by part
    image = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28, max_pixels=112 * 112
    )
    audio = WhisperFeatureExtractor(feature_size=128)
    # One preprocessor_config.json holds both, as in the Hub checkpoint.
    _write_json(path / "preprocessor_config.json", {**audio.to_dict(), **image.to_dict()})
    (path / "chat_template.jinja").write_text(spec["chat_template"])
    _write_json(path / "processor_config.json", {"processor_class": spec["processor"]})
    ids: dict[str, Any] = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_index", "<|IMAGE|>"),
            ("video_token_index", "<|VIDEO|>"),
            ("audio_token_index", "<|AUDIO|>"),
            ("vision_start_token_id", "<|vision_bos|>"),
            ("vision_end_token_id", "<|vision_eos|>"),
            ("audio_start_token_id", "<|audio_bos|>"),
            ("audio_end_token_id", "<|audio_eos|>"),
            ("user_token_id", "<|im_start|>"),
        )
    }
    text = dict(
        _TEXT,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=init_std,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=32,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[1],
        window_size=56,
        initializer_range=init_std,
    )
    audio_tower = dict(
        num_mel_bins=128,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=32,
        d_model=16,
        output_dim=32,
        n_window=50,
        initializer_range=init_std,
    )
    return transformers.Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio_tower, initializer_range=init_std, **ids
    )


_BUILDERS = {
    "gemma3": _gemma3,
    "idefics3": _idefics3,
    "mistral3": _mistral3,
    "glm4v": _glm4v,
    "glm4v_moe": lambda path, init_std: _glm4v(path, init_std, "glm4v_moe"),
    "qwen2_5_omni_thinker": _qwen2_5_omni_thinker,
}


def write_tiny_family(directory: str | Path, family: str, seed: int = 0, init_std: float = 0.02) -> Path:
    """Write a tiny random ``family`` model directory (see the module docstring) into ``directory``."""
    import torch
    import transformers

    spec = FAMILIES[family]
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = _BUILDERS[family](path, init_std)
    config.architectures = [spec["model"]]
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model"])(config)
    with torch.no_grad():  # a matrix initialised to zeros (Gemma 3's projector) would cut the images off the loss
        for param in model.parameters():
            if param.ndim >= 2 and not param.any():
                param.normal_(0.0, init_std)
    model.save_pretrained(path)
    return path


def _token_id(tokenizer: Any, token: str) -> int:
    """The id of one token (``convert_tokens_to_ids`` of a string is an int)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int), token
    return token_id


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1))
