"""Which kind of MindSpeed MM launch a script or config is: the route ``migrate`` takes, or the refusal.

Decided from what the file says (its launcher, its entry script, its model ids), never from where it lies, so that a
user's copy of a MindSpeed MM example is treated as the example is. The reasons are :data:`~lightning_mm.commands.
refusals.REASONS`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lightning_mm.mindspeed.refusals import Refused

__all__ = [
    "refuse_script_text",
    "refuse_entry_script",
    "refuse_model_ids",
    "refuse_yaml",
    "refuse_list",
    "NATIVE_TRAINER",
    "MODEL_ID_REFUSALS",
]

NATIVE_TRAINER = re.compile(r"(^|/)mindspeed_mm/fsdp/train/trainer\.py$")
"""MindSpeed MM's native FSDP2 trainer: ``torchrun ... mindspeed_mm/fsdp/train/trainer.py cfg.yaml``."""

# A launcher word at the start of a command (after `nohup`, `stdbuf -oL`, an environment prefix).
_LAUNCHERS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"(^|[\s;|&(])msrun\s"), "mindspore", "launched with msrun"),
    (re.compile(r"(^|[\s;|&(])accelerate\s+launch\s"), "deepspeed", "launched with `accelerate launch`"),
    (re.compile(r"(^|[\s;|&(])deepspeed\s"), "deepspeed", "launched with deepspeed"),
    (re.compile(r"python3?\s+-m\s+verl\."), "rl", "runs verl's PPO/GRPO trainer"),
    (re.compile(r"(^|[\s;|&(])ray\s+start\s"), "not-training", "starts a Ray cluster"),
)

# Entry scripts (by file name or path) that start no supervised training here.
_ENTRY_SCRIPTS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"(^|/)(inference|evaluate)_\w+\.py$"), "inference", "its entry script runs inference / evaluation"),
    (re.compile(r"(^|/)\w*grpo\w*\.py$"), "rl", "its entry script runs GRPO post-training"),
    (re.compile(r"(^|/)posttrain_\w*dpo\w*\.py$"), "rl", "its entry script runs DPO post-training"),
    (
        re.compile(r"(^|/)get_\w+_feature\.py$|(^|/)feature_extraction/"),
        "feature-extraction",
        "its entry script extracts features",
    ),
    (re.compile(r"(^|/)preprocess\w*/|(^|/)\w*preprocess\w*\.py$"), "not-training", "its entry script preprocesses"),
    (re.compile(r"(^|/)mindspeed_mm/fsdp/tasks/(cosyvoice3|funasr)/"), "audio", "an audio model's own trainer"),
    (re.compile(r"(^|/)mindspeed_mm/mcore/"), "megatron-model", "MindSpeed MM's mcore model trainer"),
    (re.compile(r"(^|/)pretrain_omni\.py$"), "no-twin", "MindSpeed MM's own omni model (Bagel)"),
    (re.compile(r"(^|/)finetune_ocr2\.py$"), "no-twin", "DeepSeek-OCR 2's own trainer"),
)

MODEL_ID_REFUSALS: dict[str, tuple[str, str]] = {
    # audio and speech
    "qwen_omni": ("audio", "Qwen2.5-Omni"),
    "qwen2_5_omni_thinker": ("audio", "Qwen2.5-Omni"),
    "qwen3_omni_moe": ("audio", "Qwen3-Omni"),
    "qwen3_asr": ("audio", "Qwen3-ASR"),
    "qwen3_tts": ("audio", "Qwen3-TTS"),
    "qwen3tts": ("audio", "Qwen3-TTS"),
    "funasr": ("audio", "FunASR"),
    "cosyvoice3_lm": ("audio", "CosyVoice3"),
    "moss_tts_delay": ("audio", "MOSS-TTS"),
    # MindSpeed MM's own models (or remote code) with no Transformers / diffusers twin here
    "bagel": ("no-twin", "Bagel"),
    "FLUX": ("not-implemented", "FLUX (diffusers' FluxTransformer2DModel; no recipe here)"),
    "ltx2": (
        "not-implemented",
        "LTX-2 (diffusers' LTX2 classes; its recipe is not built here: the frozen Gemma embedding connectors that "
        "`text_encoder_path` runs on the stored prompt embeddings, which diffusers' single-file conversion drops, "
        "and the joint audio-video training)",
    ),
    "kimi_k25": ("no-twin", "Kimi-K2.5 (remote code)"),
    "kimi_k3": ("no-twin", "Kimi-K3 (remote code)"),
    "step3_vl": ("no-twin", "Step3-VL (remote code)"),
    "mimo_v25": ("no-twin", "MiMo-V2.5"),
    "mimo_v2_5": ("no-twin", "MiMo-V2.5"),
}
"""A ``model_id`` (top level or of a tower) -> (reason code, the model's name)."""


def refuse_script_text(text: str, source: str) -> None:
    """Refuse a script whose launcher is not torchrun/python training, or that launches nothing at all."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for pattern, code, why in _LAUNCHERS:
        if pattern.search(body):
            raise Refused(source, code, why)
    if not re.search(r"(^|[\s;|&(/])(torchrun|python3?)\s", body):
        raise Refused(source, "not-training", "no torchrun / python launch line")


def refuse_entry_script(script: str | None, source: str) -> None:
    """Refuse a launch by its entry script (inference, post-training, feature extraction, another trainer)."""
    if not script:
        return
    for pattern, code, why in _ENTRY_SCRIPTS:
        if pattern.search(script):
            raise Refused(source, code, f"{why} ({script})")


def _model_ids(node: Any, path: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if isinstance(node, Mapping):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "model_id" and isinstance(value, str):
                out.append((where, value))
            else:
                out += _model_ids(value, where)
    return out


def refuse_model_ids(config: Mapping[str, Any], source: str, sections: tuple[str, ...] = ()) -> None:
    """Refuse a model config (or the given sections of a YAML) naming a model of :data:`MODEL_ID_REFUSALS`."""
    nodes = [config] if not sections else [config.get(s) for s in sections]
    for node in nodes:
        for where, model_id in _model_ids(node):
            if model_id in MODEL_ID_REFUSALS:
                code, name = MODEL_ID_REFUSALS[model_id]
                raise Refused(source, code, f"{name} ({where}: {model_id})")


def refuse_yaml(config: Mapping[str, Any], source: str) -> None:
    """Refuse an accelerate / DeepSpeed config or a MindSpore LayerZero config given by itself."""
    if {"compute_environment", "distributed_type"} & set(config) or "deepspeed_config" in config:
        raise Refused(source, "deepspeed", "a Hugging Face accelerate config")
    if "zero_optimization" in config or "train_micro_batch_size_per_gpu" in config:
        raise Refused(source, "deepspeed", "a DeepSpeed config")
    if {"pipeline_class", "save_path"} <= set(config) or "pipeline_config" in config:
        raise Refused(source, "inference", "a sampling pipeline config (pipeline_class, save_path)")
    if {"evaluation_dataset", "evaluation_model"} & set(config) or "generation_config" in config:
        raise Refused(source, "inference", "an evaluation / generation config")
    encoders = [k for k in ("ae", "text_encoder") if isinstance(config.get(k), Mapping)]
    if encoders and not {"predictor", "diffusion", "model_id", "image_encoder", "text_decoder"} & set(config):
        raise Refused(source, "feature-extraction", "only the VAE and text encoder (ae, text_encoder)")
    if "image_path" in config or ("prompt" in config and "save_path" in config):
        raise Refused(source, "inference", "a sampling config (prompt / image_path)")
    if "reward" in config:
        raise Refused(source, "rl", "a reward model section (reward)")
    if "generator_ckpt" in config or "real_score_fsdp_wrap_strategy" in config:
        raise Refused(source, "rl", "Self-Forcing DMD distillation (generator, real and fake score models)")
    if config and all(isinstance(v, Mapping) and "template" in v for v in config.values()):
        raise Refused(source, "not-implemented", "HunyuanVideo 1.5's prompt templates (template)")


def refuse_list(data: Any, source: str) -> None:
    """A top-level list: MindSpeed MM's inference prompts (``infer_demo_data.json``)."""
    if isinstance(data, list) and all(isinstance(x, Mapping) and "text" in x for x in data):
        raise Refused(source, "inference", "a list of inference prompts (image, text)")
