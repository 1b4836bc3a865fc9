"""What ``lightning-mm migrate`` refuses, and why: a short list of things this project does not train.

A refusal is a :class:`Refused` error carrying one of the reason codes of :data:`REASONS`; its message names the file
and the reason. ``docs/migration.md`` lists the codes, and ``tests/data/mindspeed_corpus/expected.yaml`` gives the
outcome of every file MindSpeed MM ships in ``examples/``.
"""

from __future__ import annotations

from lightning_mm.mindspeed.keys import MindSpeedConfigError

__all__ = ["REASONS", "Refused", "refuse"]

REASONS: dict[str, str] = {
    "audio": "an audio or speech model (Qwen2.5-Omni, Qwen3-Omni, Qwen3-ASR, Qwen3-TTS, FunASR, CosyVoice3, "
    "MOSS-TTS): lightning-mm has no audio data path or audio towers",
    "deepspeed": "a DeepSpeed / Hugging Face accelerate launch (MindSpeed MM's diffusers and DiffSynth examples): "
    "another trainer's script, not MindSpeed MM's",
    "mindspore": "a MindSpore job (examples/mindspore): another framework",
    "rl": "reinforcement-learning, preference or distillation post-training (GRPO through verl, DanceGRPO, DPO, "
    "Self-Forcing DMD): a rollout or reward loop, not supervised training",
    "inference": "an inference, evaluation or sampling script or config: nothing is trained",
    "not-training": "a helper script that starts no training (install, patch, data preprocessing, Ray cluster start)",
    "no-twin": "a model with no Transformers or diffusers class (MindSpeed MM's own modeling code, or a checkpoint's "
    "remote code): Bagel, DeepSeek-OCR 2, Kimi-K2.5/K3, Step3-VL, MiMo-V2.5",
    "megatron-model": "a model trained with MindSpeed MM's own Megatron (mcore) modules and tensor/pipeline "
    "parallelism rather than FSDP2",
    "not-implemented": "a model or training feature whose library class exists (diffusers) but whose training "
    "recipe is not built here: HunyuanVideo 1.5's prompt templates (online text encoding), LTX-2",
    "invalid": "the file is not valid YAML / JSON as MindSpeed MM ships it",
    "feature-extraction": "MindSpeed MM's feature extraction (VAE latents and text-encoder embeddings written to disk "
    "before training) is not a training job: lightning-mm reads those features (dataset_type feature); Wan 2.1's "
    "text- and image-to-video and Wan VACE's extraction is the command `lightning-mm extract-features`, run by hand; "
    "the others (HunyuanVideo, Sora, Lumina) are not written here",
}
"""Reason code -> what it covers. Kept short on purpose: anything else either migrates or is a bug."""


class Refused(MindSpeedConfigError):
    """A file ``migrate`` refuses for one of :data:`REASONS`; ``code`` is the reason code."""

    def __init__(self, source: str, code: str, detail: str = "") -> None:
        if code not in REASONS:
            raise ValueError(f"unknown refusal code {code!r}")
        self.source, self.code, self.detail = source, code, detail
        super().__init__(f"{source}: refused ({code}): {REASONS[code]}" + (f"; {detail}" if detail else ""))


def refuse(source: str, code: str, detail: str = "") -> Refused:
    """The :class:`Refused` error for ``source``."""
    return Refused(source, code, detail)
