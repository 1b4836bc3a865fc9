"""Packing for the VLM families whose images are not Qwen-VL patches (issue #37): Gemma 3 (``token_type_ids``, fixed
32x32 images), Idefics3 (one row of images and crops per sample, with ``pixel_attention_mask``) and Mistral 3 (Pixtral
images of different sizes, with ``image_sizes``).

The samples are the data path's own (``lightning_mm/testing/tiny_families.py`` models, MindSpeed MM ``huggingface`` data
through the model's processor and chat template, as tests/test_families_data.py builds and checks them); Mistral 3's,
whose processor needs torchvision, are laid out as MindSpeed MM's Pixtral plugin does with Transformers' PIL Pixtral
image processor. A packed row of three samples (images of different sizes and counts) trains in the model
``TransformersModel`` builds exactly as plain Transformers on the same samples padded (loss and every gradient, fp32,
relative 1e-5). Gemma 3 (a sliding-window and a full-attention layer, sdpa and eager) takes the row with the
per-sample masks of ``packed_block_masks``, its images seeing themselves both ways.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from lightning_mm.core.packed_rows import PackedCollator, packed_lengths
from lightning_mm.hf.chat_collate import ChatCollator
from lightning_mm.testing.tiny_families import write_tiny_family
from tests import test_families_data as family_data
from tests.test_packing import _assert_grads_equal

RTOL = 1e-5


def _data_path_samples(family: str, model_dir: Path, tmp: Path, monkeypatch: Any) -> list[dict[str, torch.Tensor]]:
    module = family_data._module(tmp, monkeypatch, family_data._config(model_dir, family))
    return [module._splits["train"][i] for i in range(3)]


def _pixtral_samples(model_dir: Path) -> list[dict[str, torch.Tensor]]:
    """``[IMG]`` per merged patch, rows ended by ``[IMG_BREAK]``, the last by ``[IMG_END]`` (MindSpeed MM's Pixtral
    plugin); pixels from Transformers' PIL Pixtral image processor; the second sample has two images."""
    from transformers import AutoTokenizer
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = PixtralImageProcessorPil.from_pretrained(model_dir)
    ids = tokenizer.convert_tokens_to_ids
    samples = []
    g = torch.Generator().manual_seed(0)
    for sizes in (((60, 40),), ((28, 64), (40, 40)), ((50, 30),)):
        images = [
            Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()) for w, h in sizes
        ]
        pixels = processor(images, patch_size=16, return_tensors="pt")
        prompt = [ids("<s>"), ids("[INST]")]
        for h, w in pixels["image_sizes"].tolist():
            image = ([ids("[IMG]")] * (w // 16) + [ids("[IMG_BREAK]")]) * (h // 16)
            image[-1] = ids("[IMG_END]")
            prompt += image
        prompt += [*tokenizer.encode("What is it?", add_special_tokens=False), ids("[/INST]")]
        answer = [*tokenizer.encode("A red square.", add_special_tokens=False), ids("</s>")]
        samples.append(
            {
                "input_ids": torch.tensor(prompt + answer),
                "attention_mask": torch.ones(len(prompt + answer), dtype=torch.long),
                "labels": torch.tensor([-100] * len(prompt) + answer),
                "pixel_values": pixels["pixel_values"],
                "image_sizes": pixels["image_sizes"],
            }
        )
    return samples


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= RTOL * max(float(b.abs().max()), 1e-12)


def _both_layer_types(model_dir: Path) -> None:
    """Gemma 3 with a sliding-window layer and a full-attention one (the tiny family has two sliding ones)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["text_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    path.write_text(json.dumps(config))


CASES = [
    ("gemma3", "sdpa"),
    ("gemma3", "eager"),
    ("idefics3", "sdpa"),
    ("mistral3", "sdpa"),
    ("glm4v", "sdpa"),
    ("glm4v_moe", "sdpa"),
    ("qwen2_5_omni_thinker", "sdpa"),
]


@pytest.mark.parametrize(("family", "attn"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_packed_row_equals_plain_transformers_unpacked(
    family: str, attn: str, tmp_path: Path, monkeypatch: Any
) -> None:
    import transformers

    from lightning_mm.modules import TransformersModel

    model_dir = write_tiny_family(tmp_path / family, family, init_std=0.2)
    if family == "gemma3":
        _both_layer_types(model_dir)
    if family == "mistral3":
        samples = _pixtral_samples(model_dir)
    else:
        samples = _data_path_samples(family, model_dir, tmp_path, monkeypatch)
    packed = PackedCollator()(samples)
    assert "attention_mask" not in packed and packed_lengths(packed["position_ids"]) == [
        [len(s["input_ids"]) for s in samples]
    ]
    model = TransformersModel({"init_from_hf_path": str(model_dir), "hf_config": {"attn_implementation": attn}}).train()
    loss = model(**packed).loss
    loss.backward()

    plain = (
        getattr(transformers, model.config.architectures[0])
        .from_pretrained(model_dir, attn_implementation=attn)
        .train()
    )
    padded = ChatCollator(pad_token_id=int(plain.config.get_text_config().pad_token_id or 0))(samples)
    ref_loss = plain(**padded).loss
    ref_loss.backward()
    assert _close(loss.detach(), ref_loss.detach()), (float(loss), float(ref_loss))
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert grads.keys() == want.keys() and any(
        "vision" in n or "visual" in n for n in want
    )  # the images reach the loss
    _assert_grads_equal(grads, want)


def test_batch_check_refuses_a_packed_gemma3_row_without_its_per_sample_masks(tmp_path: Path, monkeypatch: Any) -> None:
    """Given Transformers' own masks (no ``attention_mask``, or one not made by ``packed_block_masks``), Gemma 3
    would let a packed sample's images see the wrong tokens: the batch check refuses the row before it computes."""
    import transformers

    from lightning_mm.hf.batch_check import BatchCheckError, check_batch
    from lightning_mm.hf.packed_inputs import PackedMasks, packed_forward_inputs

    model_dir = write_tiny_family(tmp_path / "gemma3", "gemma3")
    plain = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir).train()  # no packing hook
    packed = PackedCollator()(_data_path_samples("gemma3", model_dir, tmp_path, monkeypatch))
    with pytest.raises(BatchCheckError, match="token_type_ids.*packed_forward_inputs"):
        check_batch(plain, {**packed, "use_cache": False})
    inputs = packed_forward_inputs(plain, packed)
    assert isinstance(inputs["attention_mask"], PackedMasks)
    check_batch(plain, inputs)
    with pytest.raises(BatchCheckError, match="token_type_ids"):
        check_batch(plain, {**inputs, "attention_mask": dict(inputs["attention_mask"])})


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_neat_packing_data_config_trains_these_families(family: str, tmp_path: Path, monkeypatch: Any) -> None:
    """MindSpeed MM's ``neat_packing`` for these families: the data module packs the three records into one row
    (Idefics3: one row of all their images and crops) that the model ``TransformersModel`` builds trains."""
    from lightning_mm.modules import TransformersModel

    model_dir = write_tiny_family(tmp_path / family, family)
    config = family_data._config(model_dir, family, basic={"neat_packing": True, "cutoff_len": 512})
    module = family_data._module(tmp_path, monkeypatch, config)
    (batch,) = list(module.train_dataloader())
    samples = [module._splits["train"][i] for i in range(3)]
    assert sorted(packed_lengths(batch["position_ids"])[0]) == sorted(len(s["input_ids"]) for s in samples)
    images = sum(s["pixel_values"].shape[1 if family == "idefics3" else 0] for s in samples)
    assert batch["pixel_values"].shape[1 if family == "idefics3" else 0] == images
    model = TransformersModel({"init_from_hf_path": str(model_dir)}).train()
    loss = model(**batch).loss  # the batch check accepts the row, and counts its images
    assert torch.isfinite(loss)
