"""Wan feature extraction (text- and image-to-video) as MindSpeed MM's ``mindspeed_mm/tools/feature_extraction/
get_wan_feature.py`` (with ``get_sora_feature.py``'s ``FeatureExtractor``) writes it, without Lightning.

Per sample, ``OUT/features/<name>.pt`` is a ``torch.save`` dict with MindSpeed MM's keys: ``video`` (the frozen
``AutoencoderKLWan``'s latents, the mode of its latent distribution normalised with its config's ``latents_mean`` /
``latents_std``, ``(C, F, H, W)``), ``prompt_ids`` (the last hidden state of the UMT5 / T5 text encoder, ``(L, D)``)
and ``prompt_mask`` (the tokenizer's attention mask, ``(L,)``); ``<name>`` is MindSpeed MM's
``_generate_safe_filename`` of the source video (its base name, dots as underscores, ``.pt``). ``OUT/data.jsonl``
holds each source record with ``file: features/<name>.pt``: the records of ``dataset_type: feature``
(:mod:`lightning_mm.mindspeed.feature_data`).

Text as MindSpeed MM's ``T2VDataset`` tokenizes it: ``whitespace_clean`` (runs of white space as one space,
stripped) when ``enable_text_preprocessing``, then the tokenizer with ``padding="max_length"``, truncation and
``max_length`` = ``model_max_length``.

Image-to-video (``task: i2v``) adds MindSpeed MM's ``wan_i2v_processor.py`` keys from the video's first frame, as
its Wan 2.1 recipe's ``first_frame_clip`` / ``first_frame_vae`` pipelines prepare it (:func:`first_frame_inputs`):
``i2v_clip_feature``, the ``CLIPVisionModel``'s ``hidden_states[-2]`` ``(N, D)``, and ``i2v_vae_feature``, the
first frame followed by black frames encoded as the video is, after the first-frame mask on four channels
``(4 + C, F, H, W)``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_mm.errors import ConfigError, LightningMMError, MissingFileError

__all__ = [
    "FeatureOutputError",
    "TEXT_ENCODERS",
    "text_encoder_class",
    "WanFeatureEncoders",
    "feature_file_name",
    "whitespace_clean",
    "check_outputs",
    "save_features",
    "CLIP_MEAN",
    "CLIP_STD",
    "first_frame_inputs",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""The ``norm_fun`` of MindSpeed MM's Wan 2.1 ``first_frame_clip`` pipeline (OpenAI CLIP's)."""


def _resize(image: torch.Tensor, size: tuple[int, int], mode: str, antialias: bool) -> torch.Tensor:
    """MindSpeed MM's ``ResizeVideo``: unchanged when already ``size``, else ``F.interpolate``."""
    if tuple(image.shape[-2:]) == size:
        return image
    return torch.nn.functional.interpolate(image, size=size, mode=mode, align_corners=False, antialias=antialias)


def first_frame_inputs(
    frame: torch.Tensor, height: int, width: int, clip_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 (H, W, 3)`` first frame -> ``(CLIP pixel values (1, 3, clip_size, clip_size), VAE frame (3, height,
    width) in [-1, 1])``, as MindSpeed MM's Wan 2.1 i2v feature extraction: ``video_and_first_frame`` (short-side
    ``ResizeVideo`` to ``(height, width)``, bilinear, antialiased; ``ToTensorVideo``), then ``first_frame_clip``
    (resized to ``clip_size`` square, bicubic; ``CLIP_MEAN`` / ``CLIP_STD``) and ``first_frame_vae`` (resized to
    ``(height, width)``, bilinear; mean and std 0.5)."""
    h, w = frame.shape[:2]
    if h / w < height / width:  # MindSpeed MM's shortsideresize
        size = (height, int(height / h * w))
    else:
        size = (int(width / w * h), width)
    image = _resize(frame.permute(2, 0, 1)[None].float(), size, "bilinear", True) / 255.0
    clip = _resize(image, (clip_size, clip_size), "bicubic", False)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (CLIP_MEAN, CLIP_STD))
    vae = _resize(image, (height, width), "bilinear", False)
    return (clip - mean) / std, ((vae - 0.5) / 0.5)[0]


class FeatureOutputError(LightningMMError, FileExistsError):
    """An output file of feature extraction exists already, or would lie outside the output directory."""


def feature_file_name(video: str) -> str:
    """MindSpeed MM's ``_generate_safe_filename``: ``/a/b/clip.v1.mp4`` -> ``clip_v1_mp4.pt``."""
    return os.path.basename(video).replace(".", "_") + ".pt"


def whitespace_clean(text: str) -> str:
    """MindSpeed MM's ``whitespace_clean`` text preprocessing: runs of white space as one space, stripped."""
    return re.sub(r"\s+", " ", text).strip()


def check_outputs(root: Path, names: list[str]) -> list[Path]:
    """The paths of ``names`` under ``root``; each must lie inside ``root`` and not exist yet (nothing is
    overwritten), else a :class:`FeatureOutputError` naming the file."""
    root = root.resolve()
    paths = []
    for name in names:
        path = (root / name).resolve()
        if not path.is_relative_to(root) or path == root:
            raise FeatureOutputError(f"{name}: the output file would lie outside the output directory {root}")
        if path.exists() or path.is_symlink():
            raise FeatureOutputError(f"{path}: exists already; feature extraction does not overwrite files")
        paths.append(path)
    return paths


def save_features(path: Path, features: dict[str, torch.Tensor]) -> None:
    """``torch.save`` to ``path``, which must not exist (opened with ``x``: never overwritten)."""
    try:
        with open(path, "xb") as handle:
            torch.save({k: v.detach().cpu().contiguous() for k, v in features.items()}, handle)
    except FileExistsError:
        raise FeatureOutputError(f"{path}: exists already; feature extraction does not overwrite files") from None


TEXT_ENCODERS = ("UMT5EncoderModel", "T5EncoderModel")
"""The text encoder classes of the Wan pipelines (diffusers' ``WanPipeline.text_encoder`` is ``UMT5EncoderModel``)."""


def text_encoder_class(path: Path) -> str:
    """The Transformers class named by ``path/config.json``'s ``architectures``; one of :data:`TEXT_ENCODERS`."""
    import json

    config = path / "config.json"
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError) as err:
        raise MissingFileError(f"{config}: not a readable config.json ({err})") from None
    if len(architectures) != 1 or architectures[0] not in TEXT_ENCODERS:
        raise ConfigError(f"{config}: architectures {architectures}: the Wan text encoder is one of {TEXT_ENCODERS}")
    return str(architectures[0])


@dataclass
class WanFeatureEncoders:
    """The frozen ``AutoencoderKLWan``, tokenizer and text encoder (``save_pretrained`` directories), on
    ``device``, in eval mode."""

    vae: Any
    tokenizer: Any
    text_encoder: Any
    max_length: int
    device: torch.device
    image_encoder: Any = None

    @classmethod
    def load(
        cls,
        vae: Path,
        text_encoder: Path,
        tokenizer: Path,
        max_length: int,
        device: str = "cpu",
        image_encoder: Path | None = None,
    ) -> WanFeatureEncoders:
        """Load the three (and the i2v ``CLIPVisionModel``) from their directories (local files only, no remote
        code)."""
        import transformers
        from diffusers import AutoencoderKLWan

        given = (("--vae", vae), ("--text-encoder", text_encoder), ("--tokenizer", tokenizer))
        for what, path in (*given, ("--image-encoder", image_encoder)):
            if path is not None and not path.is_dir():
                raise MissingFileError(f"{what} {path}: not a save_pretrained directory")
        target = torch.device(device)
        loaded_vae = AutoencoderKLWan.from_pretrained(vae, local_files_only=True).to(target).eval()
        encoder_class = getattr(transformers, text_encoder_class(text_encoder))
        encoder = encoder_class.from_pretrained(text_encoder, local_files_only=True)
        loaded_tokenizer = transformers.AutoTokenizer.from_pretrained(
            tokenizer, local_files_only=True, trust_remote_code=False
        )
        image: Any = None
        if image_encoder is not None:
            image = transformers.CLIPVisionModel.from_pretrained(image_encoder, local_files_only=True)
            image = image.to(target).eval().requires_grad_(False)
        return cls(
            loaded_vae.requires_grad_(False),
            loaded_tokenizer,
            encoder.to(target).eval().requires_grad_(False),
            max_length,
            target,
            image,
        )

    @torch.no_grad()
    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """CLIP pixel values ``(1, 3, S, S)`` -> the image encoder's ``hidden_states[-2]`` ``(N, D)`` (float32)."""
        dtype = next(self.image_encoder.parameters()).dtype
        out = self.image_encoder(pixel_values=pixels.to(self.device, dtype), output_hidden_states=True)
        return out.hidden_states[-2][0].float().cpu()

    @torch.no_grad()
    def encode_condition(self, first: torch.Tensor, num_frames: int) -> torch.Tensor:
        """``wan_i2v_processor.py``'s ``i2v_vae_feature``: the first frame ``(3, H, W)`` then ``num_frames - 1``
        black frames, encoded as :meth:`encode_video`, after the mask (1 on the first frame's latent frame) on
        four channels ``(4 + C, F, H', W')``. The mask's frames are the VAE's temporal factor (4 in Wan: the 4 that
        MindSpeed MM writes)."""
        video = torch.cat([first[:, None], first.new_zeros(3, num_frames - 1, *first.shape[1:])], dim=1)
        latents = self.encode_video(video)
        factor = 2 ** sum(bool(t) for t in self.vae.config.temperal_downsample)
        _, frames, h, w = latents.shape
        mask = torch.ones(num_frames, h, w)
        mask[1:] = 0
        mask = torch.cat([mask[0:1].repeat_interleave(factor, dim=0), mask[1:]], dim=0)
        if mask.shape[0] != frames * factor:
            raise ConfigError(f"num_frames {num_frames}: expected 1 + a multiple of the VAE's temporal factor {factor}")
        mask = mask.view(frames, factor, h, w).transpose(0, 1)
        return torch.cat([mask.to(latents.dtype), latents], dim=0)

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """``(3, T, H, W)`` in ``[-1, 1]`` -> normalised latents ``(C, F, H', W')`` (float32, on the CPU)."""
        dtype = next(self.vae.parameters()).dtype
        latents = self.vae.encode(video[None].to(self.device, dtype)).latent_dist.mode()
        mean = torch.tensor(self.vae.config.latents_mean, dtype=latents.dtype, device=latents.device)
        std = torch.tensor(self.vae.config.latents_std, dtype=latents.dtype, device=latents.device)
        return ((latents - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1))[0].float().cpu()

    def tokenize(self, caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)``, each ``(1, max_length)``."""
        tokens = self.tokenizer(
            caption,
            max_length=self.max_length,
            padding="max_length",
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return tokens["input_ids"], tokens["attention_mask"]

    @torch.no_grad()
    def encode_text(self, caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_ids (L, D) float32, prompt_mask (L,))`` of ``caption`` (already preprocessed)."""
        ids, mask = self.tokenize(caption)
        out = self.text_encoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        return out.last_hidden_state[0].float().cpu(), mask[0]
