"""Samples of MindSpeed MM's named templates equal MindSpeed MM's own (its FSDP2 route, commit 57069cd5).

The reference (``tests/helpers/mindspeed_reference.py``) RE-TELLS MindSpeed MM's code, function by function, from
``mindspeed_mm/fsdp/data/data_utils/func_utils/`` (``convert.py``: ``SharegptDatasetConverter``,
``SupervisedDatasetProcessor._encode_data_example``, ``infer_seqlen``; ``template.py``: the registered slots,
``Template._encode``, ``_convert_elements_to_ids``, ``ReasoningTemplate.encode_multiturn``; ``mm_plugin.py``:
``MMPluginMixin._preprocess_image``, ``Qwen2VLPlugin._preprocess_image``, the plugins' ``_get_mm_inputs`` and
``process_messages``) and ``collator.py`` (the pixels of a batch: ``get_mm_inputs`` of the sample's images). It
uses only the tiny models' tokenizer and image processor as Transformers loads them (``AutoTokenizer``,
``AutoImageProcessor``), never this project's code. Each sample built through ``MMDataModule(data_config=...)`` is
compared with it: input ids, labels, pixel values and image grids, for each template on a tiny model of its family
(``lightning_mm/testing/tiny_vlms.py``, ``lightning_mm/testing/tiny_families.py``): a picture above
``image_max_pixels``, one below the image processor's own minimum and narrower than 28 pixels, several images, several
turns, system prompts (default, column, turn with white space), existing thoughts, the label modes, and cuts at small
``cutoff_len``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from lightning_mm import MMDataModule
from lightning_mm.testing.tiny_families import write_tiny_family
from lightning_mm.testing.tiny_vlms import write_tiny_vlm
from tests.helpers.mindspeed_reference import (
    IGNORE_INDEX,
    IMAGE_PLACEHOLDER,
    REF_PLUGINS,
    REF_TEMPLATES,
    ref_encode_data_example,
    ref_encode_multiturn,
    ref_preprocess_image,
    ref_process_messages,
    ref_sharegpt,
)
from tests.helpers.mindspeed_reference import reference as _ms_reference


def reference(model: Path, name: str, record: dict, data: Path, **overrides: Any) -> dict[str, torch.Tensor]:
    return _ms_reference(model, name, record, data, MAX_PIXELS, MIN_PIXELS, **overrides)


# ================================================================================ the data
ATTR = {
    "system": "system",
    "images": "images",
    "messages": "messages",
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "system_tag": "system",
}
MAX_PIXELS = 64 * 64
MIN_PIXELS = 32 * 32
IMAGES = {"big.png": (300, 200), "small.png": (20, 30), "a.png": (60, 40), "b.png": (28, 84), "p.png": (45, 45)}
FAMILY_OF = {
    "qwen2vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_nothink": "qwen3_vl",
    "qwen2_omni": "qwen2_5_omni_thinker",
    "glm4.1v": "glm4v",
    "glm4v_moe": "glm4v_moe",
}


def _record(turns: list[tuple[str, str]], images: list[str] | None = None, **extra: Any) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns], "images": images or [], **extra}


RECORDS = {
    "large picture": _record(
        [("user", "<image>What is in this picture?"), ("assistant", "A red square.")], ["big.png"]
    ),
    "small picture": _record([("user", "<image>How many?"), ("assistant", "One dog.")], ["small.png"]),
    "multi-image": _record(
        [("user", "Two <image> and <image> shapes?"), ("assistant", "Yes, two.")],
        ["a.png", "b.png"],
        system="Be brief.",
    ),
    "multi-turn": _record(
        [
            ("system", "  You are terse.\n"),
            ("user", " <image>Describe the image.\n"),
            ("assistant", "<think>cats</think>\n\nTwo cats. "),
            ("user", "How many?"),
            ("assistant", "The answer is 2."),
            ("user", "Left or right?"),
            ("assistant", "left"),
        ],
        ["p.png"],
    ),
    "text only": _record([("user", "Hello world!"), ("assistant", "Hello! How many shapes? 0 1 2 3.")]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mindspeed")
    out = {f: write_tiny_vlm(root / f, f) for f in ("qwen2_5_vl", "qwen3_vl")}
    out.update({f: write_tiny_family(root / f, f) for f in ("glm4v", "glm4v_moe", "qwen2_5_omni_thinker")})
    return out


def _dataset(tmp: Path, monkeypatch, model: Path, name: str, records: list[dict], basic: dict | None = None, **pre):
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for i, (image, size) in enumerate(IMAGES.items()):
        g = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(data / image)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {
        "dataset_param": {
            "dataset_type": "huggingface",
            "preprocess_parameters": {
                "model_name_or_path": str(model),
                "image_max_pixels": MAX_PIXELS,
                "image_min_pixels": MIN_PIXELS,
                **pre,
            },
            "basic_parameters": {"template": name, "dataset_dir": "./data", "dataset": "./data/train.jsonl"}
            | (basic or {}),
            "attr": ATTR,
        },
        "dataloader_param": {"dataloader_mode": "sampler", "collate_param": {}},
        "strict": True,
    }
    (tmp / "data.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp)
    module = MMDataModule(data_config=tmp / "data.json")
    module.setup()
    _dataset.module = module  # type: ignore[attr-defined]
    return module._splits["train"], data


def _assert_same(sample: dict, ref: dict) -> None:
    for key, value in ref.items():
        assert key in sample, key
        assert sample[key].shape == value.shape, (key, sample[key].shape, value.shape)
        assert torch.equal(sample[key], value.to(sample[key].dtype)), key
    assert set(sample) == set(ref)
    assert torch.equal(sample["attention_mask"], torch.ones_like(sample["input_ids"]))


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_samples_equal_mindspeed_mm(name, models, tmp_path, monkeypatch):
    model = models[FAMILY_OF[name]]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, list(RECORDS.values()))
    for i, (what, record) in enumerate(RECORDS.items()):
        sample = dataset[i]
        ref = reference(model, name, record, data)
        try:
            _assert_same(sample, ref)
        except AssertionError as err:
            raise AssertionError(f"{name}, {what}: {err}") from None


@pytest.mark.parametrize("name", ["qwen2vl", "qwen3_vl", "glm4.1v"])
@pytest.mark.parametrize(
    "flags",
    [{"train_on_prompt": True}, {"mask_history": True}, {"train_on_prompt": True, "mask_history": True}],
    ids=["train_on_prompt", "mask_history", "both"],
)
def test_label_modes_equal_mindspeed_mm(name, flags, models, tmp_path, monkeypatch):
    model = models[FAMILY_OF[name]]
    record = RECORDS["multi-turn"]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, [record], flags)
    _assert_same(dataset[0], reference(model, name, record, data, **flags))


@pytest.mark.parametrize("name", ["qwen2vl", "qwen3_vl", "glm4.1v"])
@pytest.mark.parametrize("flags", [{}, {"mask_history": True}], ids=["plain", "mask_history"])
def test_cutoff_len_cuts_each_turn_in_proportion_as_mindspeed_mm(name, flags, models, tmp_path, monkeypatch):
    model = models[FAMILY_OF[name]]
    record = RECORDS["multi-turn"]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, [record], {"cutoff_len": 10_000} | flags)
    full = len(dataset[0]["input_ids"])
    # Past the image (the first prompt, with its image tokens, and its answer); then the later turns are cut.
    first = reference(model, name, record | {"messages": record["messages"][:3]}, data)
    # With mask_history the last turns come first, and the first turn (the image's) is cut at its end.
    cutoffs = (full - 3, full - 1) if flags else (len(first["input_ids"]) + 9, len(first["input_ids"]) + 4, full - 3)
    for cutoff in cutoffs:
        dataset, data = _dataset(tmp_path, monkeypatch, model, name, [record], {"cutoff_len": cutoff} | flags)
        ref = reference(model, name, record, data, cutoff_len=cutoff, **flags)
        assert len(ref["input_ids"]) < full
        _assert_same(dataset[0], ref)
    text = RECORDS["text only"]
    for cutoff in (5, 9, 14):
        dataset, data = _dataset(tmp_path, monkeypatch, model, name, [text], {"cutoff_len": cutoff} | flags)
        _assert_same(dataset[0], reference(model, name, text, data, cutoff_len=cutoff, **flags))


def test_a_cut_through_an_image_is_refused_by_name(models, tmp_path, monkeypatch):
    """MindSpeed MM would build a sample whose image tokens do not match its pixels (the model then fails)."""
    from lightning_mm.data.record_files import DataError

    model = models["qwen2_5_vl"]
    dataset, _ = _dataset(tmp_path, monkeypatch, model, "qwen2vl", [RECORDS["large picture"]], {"cutoff_len": 24})
    with pytest.raises(DataError, match="cutoff_len 24 cuts the sample through its images' tokens"):
        dataset[0]


@pytest.mark.parametrize("name", ["qwen3_vl", "glm4.1v"])
def test_enable_thinking_false_makes_the_empty_thought_prompt(name, models, tmp_path, monkeypatch):
    """MindSpeed MM's ReasoningTemplate with ``enable_thinking = False`` (its FSDP route never sets it: a
    documented difference, the config's value is honoured here)."""
    model = models[FAMILY_OF[name]]
    record = RECORDS["multi-turn"]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, [record], {"enable_thinking": False})
    _assert_same(dataset[0], reference(model, name, record, data, enable_thinking=False))


def test_qwen3_6_on_a_qwen3_vl_processor(models):
    """``qwen3_6`` (Qwen3.5 / Qwen3.6) is ``qwen3_vl``'s slots and plugin; checked on the builder directly (no tiny
    Qwen3.5 directory here)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from lightning_mm.hf.mindspeed_samples import MINDSPEED_FORMATS, MindSpeedSampleBuilder
    from lightning_mm.hf.vlm_processor import load_vlm_processor

    model = models["qwen3_vl"]
    builder = MindSpeedSampleBuilder(
        load_vlm_processor(model).processor,
        MINDSPEED_FORMATS["qwen3_6"],
        image_max_pixels=MAX_PIXELS,
        image_min_pixels=MIN_PIXELS,
        cutoff_len=1024,
    )
    record = RECORDS["text only"]
    messages, system = ref_sharegpt(record)
    sample = builder(messages, system, [])
    tokenizer = AutoTokenizer.from_pretrained(model)
    AutoImageProcessor.from_pretrained(model)
    pairs = ref_encode_multiturn(tokenizer, messages, system, REF_TEMPLATES["qwen3_6"], True)
    args = dict(cutoff_len=1024, train_on_prompt=False, mask_history=False)
    ids, labels = ref_encode_data_example(tokenizer, pairs, REF_TEMPLATES["qwen3_6"], args)
    assert sample["input_ids"].tolist() == ids and sample["labels"].tolist() == labels


@pytest.mark.parametrize("name", ["qwen2vl", "qwen3_vl"])
def test_the_filler_image_is_mindspeed_mms(name, models, tmp_path, monkeypatch):
    """MindSpeed MM's collator: a batch without images gets one 64x64 white image through process_messages and
    get_mm_inputs, its tokens appended to the first sample, masked."""
    from transformers import AutoImageProcessor, AutoTokenizer

    model = models[FAMILY_OF[name]]
    text = RECORDS["text only"]
    dataset, data = _dataset(tmp_path, monkeypatch, model, name, [text])
    batch = _dataset.module.train_dataloader().collate_fn([dataset[0]])  # type: ignore[attr-defined]
    tokenizer = AutoTokenizer.from_pretrained(model)
    image_processor = AutoImageProcessor.from_pretrained(model)
    plugin = REF_TEMPLATES[name]["plugin"]
    fake = Image.new("RGB", (64, 64), (255, 255, 255))
    resample = REF_PLUGINS[plugin][0]
    mm_inputs = dict(
        image_processor([ref_preprocess_image(fake, MAX_PIXELS, MIN_PIXELS, resample)], return_tensors="pt")
    )
    messages = ref_process_messages(
        [{"role": "user", "content": IMAGE_PLACEHOLDER}], mm_inputs, image_processor, plugin
    )
    fake_ids = tokenizer.encode(messages[0]["content"], add_special_tokens=False)
    ref = reference(model, name, text, data)
    assert batch["input_ids"][0].tolist() == ref["input_ids"].tolist() + fake_ids
    assert batch["labels"][0].tolist() == ref["labels"].tolist() + [IGNORE_INDEX] * len(fake_ids)
    assert batch["attention_mask"][0].tolist() == [1] * len(ref["input_ids"]) + [0] * len(fake_ids)
    assert torch.equal(batch["pixel_values"], mm_inputs["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], mm_inputs["image_grid_thw"])
