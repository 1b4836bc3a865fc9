"""Token counts of MindSpeed MM chat samples for token-budget batches, without processing their images
(``lightning_mm.hf.chat_lengths``): each equals the length of the sample the builder gives (``len(dataset[i]
["input_ids"])``; those samples are checked against MindSpeed MM's re-told code in ``tests/test_mindspeed_samples.py``
and against the model's own processor in ``tests/test_hf_data.py``), and the image processor is not called.

Every MindSpeed MM named template (``qwen2vl``, ``qwen3_vl``, ``qwen3_vl_nothink``, ``qwen2_omni``, ``glm4.1v``,
``glm4v_moe`` through ``MMDataModule``; ``qwen3_6`` on the builder, there is no tiny Qwen3.5 directory) on a picture
above ``image_max_pixels``, one below ``image_min_pixels`` and narrower than 28 pixels, two images, several turns
with a system prompt and a thought, text only; uncut, and cut by ``cutoff_len`` turn by turn (``infer_seqlen``),
with ``mask_history`` too; a cut that refuses records (through an image's tokens) gives no count and the record is
built (and replaced). The model's own chat template (``template: null``) likewise, cut at its end. Families whose
processor adds text around the image tokens (Gemma 3) build their samples to count them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from lightning_mm import MMDataModule
from lightning_mm.datamodules.token_budget_loader import sample_lengths
from lightning_mm.hf.chat_lengths import chat_sample_length, counts_lengths
from lightning_mm.hf.chat_samples import SampleError
from lightning_mm.testing.tiny_families import write_tiny_family
from lightning_mm.testing.tiny_vlms import write_tiny_vlm
from tests import test_families_data as families

MAX_PIXELS = 64 * 64
MIN_PIXELS = 32 * 32
# big: above MAX_PIXELS; small: below MIN_PIXELS, narrower than 28; wide: an aspect ratio the bounds keep
IMAGES = {"big.png": (300, 200), "small.png": (20, 30), "a.png": (60, 40), "b.png": (28, 84), "p.png": (45, 45)}
FAMILY_OF = {
    "qwen2vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_nothink": "qwen3_vl",
    "qwen2_omni": "qwen2_5_omni_thinker",
    "glm4.1v": "glm4v",
    "glm4v_moe": "glm4v_moe",
}
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


def _record(turns: list[tuple[str, str]], images: list[str] | None = None, **extra: Any) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns], "images": images or [], **extra}


RECORDS = [
    _record([("user", "<image>What is in this picture?"), ("assistant", "A red square.")], ["big.png"]),
    _record([("user", "<image>How many?"), ("assistant", "One dog.")], ["small.png"]),
    _record(
        [("user", "Two <image> and <image> shapes?"), ("assistant", "Yes, two.")],
        ["a.png", "b.png"],
        system="Be brief.",
    ),
    _record(
        [
            ("system", "You are terse."),
            ("user", "<image>Describe the image."),
            ("assistant", "<think>cats</think>\n\nTwo cats."),
            ("user", "How many? Count them one by one, left to right."),
            ("assistant", "The answer is 2, one on the left and one on the right."),
            ("user", "Left or right?"),
            ("assistant", "left"),
        ],
        ["p.png"],
    ),
    _record([("user", "Hello world!"), ("assistant", "Hello! How many shapes? 0 1 2 3.")]),
]
MULTI_TURN = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lengths")
    out = {f: write_tiny_vlm(root / f, f) for f in ("qwen2_5_vl", "qwen3_vl")}
    out.update({f: write_tiny_family(root / f, f) for f in ("glm4v", "glm4v_moe", "qwen2_5_omni_thinker")})
    return out


def _dataset(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, model: Path, template: str | None, strict: bool = True, **basic: Any
) -> Any:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for i, (image, size) in enumerate(IMAGES.items()):
        g = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(data / image)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    config = {
        "dataset_param": {
            "dataset_type": "huggingface",
            "preprocess_parameters": {
                "model_name_or_path": str(model),
                "image_max_pixels": MAX_PIXELS,
                "image_min_pixels": MIN_PIXELS,
            },
            "basic_parameters": {"template": template, "dataset_dir": "./data", "dataset": "./data/train.jsonl"}
            | basic,
            "attr": ATTR,
        },
        "dataloader_param": {"dataloader_mode": "sampler", "collate_param": {}},
        "strict": strict,
    }
    (tmp / "data.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp)
    module = MMDataModule(data_config=tmp / "data.json")
    module.setup()
    return module._splits["train"]


def _count_image_calls(monkeypatch: pytest.MonkeyPatch, builder: Any) -> list[Any]:
    """Every call of the builder's image processor, recorded."""
    image_processor = builder.processor.image_processor
    calls: list[Any] = []
    original = type(image_processor).__call__

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(image_processor), "__call__", counting)
    return calls


def _assert_lengths_without_images(dataset: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The planned lengths equal the built samples' and no image was processed to plan them; the built lengths."""
    assert counts_lengths(dataset.builder)
    calls = _count_image_calls(monkeypatch, dataset.builder)
    lengths = sample_lengths(dataset)  # what the token-budget loader plans with
    assert calls == []  # no image was processed
    built = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    assert len(calls) == sum(bool(r["images"]) for r in RECORDS)  # they are when the samples are built
    assert lengths == built
    assert len(set(built)) > 2  # the records differ in length
    return built


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_lengths_equal_the_built_samples_and_process_no_image(
    name: str, models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uncut (``cutoff_len`` 10000), then cut turn by turn: 3 tokens below the longest sample (the multi-turn one,
    its last answer cut) and 12 below it (its later turns cut in proportion); with ``mask_history`` 3 below it (the
    last turns first, the end of the image's turn cut)."""
    model = models[FAMILY_OF[name]]
    full = _assert_lengths_without_images(_dataset(tmp_path, monkeypatch, model, name, cutoff_len=10_000), monkeypatch)
    longest = max(full)
    assert full.index(longest) == MULTI_TURN
    for flags, cuts in (({}, (3, 12)), ({"mask_history": True}, (3,))):
        for cutoff in (longest - n for n in cuts):
            monkeypatch.undo()
            dataset = _dataset(tmp_path, monkeypatch, model, name, cutoff_len=cutoff, **flags)
            cut = _assert_lengths_without_images(dataset, monkeypatch)
            assert cut[MULTI_TURN] <= cutoff and [n for i, n in enumerate(cut) if i != MULTI_TURN] == [
                n for i, n in enumerate(full) if i != MULTI_TURN
            ]


@pytest.mark.parametrize(
    ("name", "family", "cutoff"),
    [("qwen2vl", "qwen2_5_vl", 12), ("glm4.1v", "glm4v", 12), (None, "qwen2_5_vl", 35)],
    ids=str,
)
def test_a_cut_the_builder_refuses_is_built_not_counted(
    name: str | None,
    family: str,
    cutoff: int,
    models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small ``cutoff_len`` cuts through the image tokens of some records: those get no count (``None``) without an
    image processed, exactly the records the builder refuses; they are built (refused there, replaced by the next
    good record) and their replacement's length is planned. The others are counted, cut. ``None``: the model's own
    chat template, cut at the end (through the images, or past every trained token)."""
    model = models[family]
    dataset = _dataset(tmp_path, monkeypatch, model, name, strict=False, cutoff_len=cutoff)
    builder = dataset.builder
    calls = _count_image_calls(monkeypatch, builder)
    counted, built = [], []
    for record in dataset.records:
        messages = [{"role": role, "content": content} for role, content in record.messages]
        counted.append(chat_sample_length(builder, messages, record.system, [_image_size(p) for p in record.images]))
        assert calls == []
        try:
            built.append(
                len(builder(messages, record.system, [Image.open(p).copy() for p in record.images])["input_ids"])
            )
        except SampleError as err:
            assert "images' tokens" in str(err) or "no trained token" in str(err)
            built.append(None)
        calls.clear()
    assert counted == built
    assert None in built and cutoff in built
    with pytest.warns(UserWarning, match="the next good record is used in its place"):
        lengths = sample_lengths(dataset)
    assert lengths == [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


def test_qwen3_6_lengths_on_the_builder(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """``qwen3_6`` (Qwen3.5 / Qwen3.6: Transformers' Qwen3-VL processor), on the builder directly: every record,
    uncut and cut turn by turn."""
    from lightning_mm.hf.mindspeed_samples import MINDSPEED_FORMATS, MindSpeedSampleBuilder
    from lightning_mm.hf.vlm_processor import load_vlm_processor

    processor = load_vlm_processor(models["qwen3_vl"]).processor
    images = {}
    for i, (name, size) in enumerate(IMAGES.items()):
        g = torch.Generator().manual_seed(i)
        images[name] = Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g).byte().numpy())
    for cutoff in (10_000, 60, 40):
        builder = MindSpeedSampleBuilder(
            processor,
            MINDSPEED_FORMATS["qwen3_6"],
            image_max_pixels=MAX_PIXELS,
            image_min_pixels=MIN_PIXELS,
            cutoff_len=cutoff,
        )
        calls = _count_image_calls(monkeypatch, builder)
        for record in RECORDS:
            turns = [m for m in record["messages"] if m["role"] != "system"]
            system = next((m["content"] for m in record["messages"] if m["role"] == "system"), record.get("system"))
            pictures = [images[n] for n in record["images"]]
            length = chat_sample_length(builder, turns, system, [p.size for p in pictures])
            assert calls == []
            try:
                built = len(builder(turns, system, pictures)["input_ids"])
            except SampleError:
                built = None
            calls.clear()
            assert length == built, (cutoff, record)
            assert length is None or length <= cutoff
        monkeypatch.undo()


def test_a_picture_bounded_to_nothing_is_built_not_counted(models: dict[str, Path]) -> None:
    """A 9000 x 1 picture above ``image_max_pixels``: the plugin's resize gives it no height, which PIL refuses, so
    the record fails when built; it gets no count (the size-only stand-in refuses it too)."""
    from lightning_mm.hf.mindspeed_samples import MINDSPEED_FORMATS, MindSpeedSampleBuilder
    from lightning_mm.hf.vlm_processor import load_vlm_processor

    builder = MindSpeedSampleBuilder(
        load_vlm_processor(models["qwen2_5_vl"]).processor,
        MINDSPEED_FORMATS["qwen2vl"],
        image_max_pixels=MAX_PIXELS,
        image_min_pixels=MIN_PIXELS,
    )
    messages = [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A line."}]
    with pytest.raises(ValueError, match="height and width must be > 0"):
        builder(messages, None, [Image.new("RGB", (9000, 1))])
    assert chat_sample_length(builder, messages, None, [(9000, 1)]) is None
    assert chat_sample_length(builder, messages, None, [(90, 10)]) == len(
        builder(messages, None, [Image.new("RGB", (90, 10))])["input_ids"]
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_lengths_with_the_models_own_chat_template(
    family: str, models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``template: null``: the model's chat template renders the samples, the processor expands the images; uncut
    and cut at the end 3 tokens below the longest sample."""
    model = models[family]
    full = _assert_lengths_without_images(_dataset(tmp_path, monkeypatch, model, None, cutoff_len=10_000), monkeypatch)
    monkeypatch.undo()
    dataset = _dataset(tmp_path, monkeypatch, model, None, cutoff_len=max(full) - 3)
    cut = _assert_lengths_without_images(dataset, monkeypatch)
    assert max(cut) == max(full) - 3


def test_gemma3_builds_its_samples_to_count_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's processor adds text around the image tokens: no count without the images, the samples are built."""
    model = families.write_tiny_family(tmp_path / "gemma3", "gemma3")
    dataset = families._module(tmp_path, monkeypatch, families._config(model, "gemma3"))._splits["train"]
    assert not counts_lengths(dataset.builder)
    assert sample_lengths(dataset) == [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


def _image_size(path: str) -> tuple[int, int]:
    with Image.open(path) as image:  # closed at once (no unclosed-file ResourceWarning)
        return image.size
