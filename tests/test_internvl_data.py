"""MindSpeed MM's ``dataset_type: multimodal`` data configs with InternVL's Hugging Face processor.

A sample must equal what InternVL's own processor gives for the conversation (``apply_chat_template`` with
InternVL's HF chat template, then ``processor(text=..., images=...)``), bit for bit; its labels are computed here
the way MindSpeed MM's ``preprocess_internvl2_5`` does (each turn tokenized on its own, assistant header and final
newline ignored), and its tiles are compared with MindSpeed MM's ``dynamic_preprocess`` + ``ToTensor`` +
``Normalize``, re-implemented here with PIL and NumPy.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_mm.data.data_config import DataConfigError
from lightning_mm.data.record_files import DataError
from lightning_mm.hf.internvl_processor import load_internvl_processor
from lightning_mm.mindspeed.multimodal_data import build_multimodal_datasets
from lightning_mm.testing.tiny_internvl import MEAN, STD, TILE, TOKENS_PER_TILE, build_tiny_internvl

SYSTEM = "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
SOURCE = "data.json"


def _data_json(model: str = "model", dynamic: bool = True) -> dict:
    """examples/internvl3.5/data.json of MindSpeed MM, with this test's paths and tile size."""
    return {
        "dataset_param": {
            "dataset_type": "multimodal",
            "basic_parameters": {"data_path": "train.jsonl", "data_folder": "images", "repeat_time": 1},
            "preprocess_parameters": {
                "image_reader_type": "torchvision",
                "train_pipeline": {
                    "image": [
                        {"trans_type": "Pad2Square", "param": {"mean": [0.485, 0.456, 0.406]}},
                        {
                            "trans_type": "Resize",
                            "param": {"size": [TILE, TILE], "interpolation": "BICUBIC", "antialias": None},
                        },
                        {"trans_type": "ToTensor"},
                        {
                            "trans_type": "norm_fun",
                            "param": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
                        },
                    ]
                },
            },
            "tokenizer_config": {
                "hub_backend": "hf",
                "autotokenizer_name": "AutoTokenizer",
                "from_pretrained": model,
                "add_eos_token": False,
                "use_fast": False,
            },
            "use_text_processer": True,
            "template_name": "internvl2_5",
            "patch_size": 14,
            "image_size": TILE,
            "down_sample_ratio": 0.5,
            "group_by_length": True,
            "dynamic_image_size": dynamic,
            "use_thumbnail": True,
            "min_dynamic_patch": 1,
            "max_dynamic_patch": 6,
            "min_num_frame": 8,
            "max_num_frame": 32,
            "sampling_method": "rand",
        },
        "dataloader_param": {"collate_param": {"model_name": "internvl", "pad_id": None}},
    }


def _picture(path: Path, width: int, height: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("internvl")
    model = build_tiny_internvl(root / "model")
    (root / "images").mkdir()
    for name, (w, h) in {
        "square.png": (56, 56),
        "wide.png": (112, 56),
        "tall.png": (40, 150),
        "odd.png": (100, 40),
        "small.png": (30, 20),
    }.items():
        _picture(root / "images" / name, w, h, seed=len(name) + w)
    return root, model


def _write(root: Path, lines: list, name: str = "train.jsonl") -> None:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    (root / name).write_text(text + "\n", encoding="utf-8")


def _chat(image, *turns: str) -> dict:
    roles = ["human", "gpt"] * len(turns)
    return {"image": image, "conversations": [{"from": r, "value": v} for r, v in zip(roles, turns)]}


def _build(root: Path, model, records: list, config: dict | None = None, strict: bool = False):
    _write(root, records)
    config = copy.deepcopy(config or _data_json())
    collate = config["dataloader_param"]["collate_param"]
    if collate.get("pad_id", 0) is None:
        collate["pad_id"] = model.pad_id
    return build_multimodal_datasets(config["dataset_param"], collate, root, SOURCE, strict)


# ------------------------------------------------------------------------------------------------ references
def _messages(record: dict) -> list[dict]:
    """The record as chat messages for InternVL's HF chat template (MindSpeed's system message first)."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in record["conversations"]:
        if turn["from"] == "human":
            content, text = [], turn["value"]
            while "<image>" in text:
                before, text = text.split("<image>", 1)
                if before:
                    content.append({"type": "text", "text": before})
                content.append({"type": "image"})
                text = text.removeprefix("\n")  # the template writes the image as "<IMG_CONTEXT>\n"
            content.append({"type": "text", "text": text})
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": turn["value"]}]})
    return messages


def _reference(root: Path, record: dict, max_patches: int = 6, dynamic: bool = True):
    processor = load_internvl_processor(root / "model")
    names = record["image"] if isinstance(record["image"], list) else [record["image"]]
    images = [Image.open(root / "images" / n).convert("RGB") for n in names]
    text = processor.apply_chat_template(_messages(record), tokenize=False)
    most = max_patches // len(images) if len(images) > 1 else max_patches
    out = processor(
        text=text, images=images, return_tensors="pt", crop_to_patches=dynamic, min_patches=1, max_patches=most
    )
    return processor, text, out


def _mindspeed_labels(processor, text: str, tiles_per_image: list[int]) -> tuple[list[int], list[int]]:
    """MindSpeed MM's preprocess_internvl2_5: expand the images, tokenize turn by turn, ignore all but answers."""
    tokenizer = processor.tokenizer
    for tiles in tiles_per_image:
        text = text.replace("<IMG_CONTEXT>\n", "<img>" + "<IMG_CONTEXT>" * (TOKENS_PER_TILE * tiles) + "</img>\n", 1)
    turns = ["<|im_start|>" + t for t in text.split("<|im_start|>")[1:]]
    header = len(tokenizer("<|im_start|>assistant\n")["input_ids"])
    ids, labels = [], []
    for turn in turns:
        turn_ids = tokenizer(turn)["input_ids"]
        ids += turn_ids
        if turn.startswith("<|im_start|>assistant\n"):
            target = list(turn_ids)
            target[:header] = [-100] * header
            target[-1] = -100
            labels += target
        else:
            labels += [-100] * len(turn_ids)
    return ids, labels


def _tiles_per_image(root: Path, record: dict, max_patches: int) -> list[int]:
    processor = load_internvl_processor(root / "model")
    names = record["image"] if isinstance(record["image"], list) else [record["image"]]
    most = max_patches // len(names) if len(names) > 1 else max_patches
    return [
        processor.image_processor.get_number_of_image_patches(
            *_image_size(root / "images" / n)[::-1],
            {"crop_to_patches": True, "max_patches": most, "min_patches": 1},
        )
        for n in names
    ]


def _mindspeed_tiles(image: Image.Image, min_num: int, max_num: int, size: int) -> torch.Tensor:
    """MindSpeed MM's dynamic_preprocess (use_thumbnail) + ToTensor + Normalize, with PIL and NumPy."""
    width, height = image.size
    aspect = width / height
    ratios = sorted(
        {
            (i, j)
            for n in range(min_num, max_num + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if min_num <= i * j <= max_num
        },
        key=lambda r: r[0] * r[1],
    )
    best, best_diff = (1, 1), float("inf")
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * size * size * ratio[0] * ratio[1]:
            best = ratio
    resized = image.resize((size * best[0], size * best[1]))
    tiles = [
        resized.crop((c * size, r * size, (c + 1) * size, (r + 1) * size))
        for r in range(best[1])
        for c in range(best[0])
    ]
    if len(tiles) != 1:
        tiles.append(image.resize((size, size)))
    mean, std = np.array(MEAN).reshape(3, 1, 1), np.array(STD).reshape(3, 1, 1)
    arrays = [(np.asarray(t, dtype=np.float32).transpose(2, 0, 1) / 255.0 - mean) / std for t in tiles]
    return torch.tensor(np.stack(arrays), dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ samples
@pytest.mark.parametrize("image", ["wide.png", "tall.png", "square.png"])
def test_sample_equals_the_processor_and_mindspeed_labels(tiny, image):
    root, model = tiny
    record = _chat(image, "<image>\nWhat is this?", "A cat.")
    splits, _, reports = _build(root, model, [record])
    assert reports["train"].problems == [] and splits["val"] is None and splits["test"] is None
    sample = splits["train"][0]
    processor, text, ref = _reference(root, record)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n<IMG_CONTEXT>\nWhat is")
    assert torch.equal(sample["input_ids"], ref["input_ids"][0])
    assert torch.equal(sample["pixel_values"], ref["pixel_values"])
    ids, labels = _mindspeed_labels(processor, text, _tiles_per_image(root, record, 6))
    assert sample["input_ids"].tolist() == ids
    assert sample["labels"].tolist() == labels
    trained = [t for t in sample["labels"].tolist() if t != -100]
    assert processor.tokenizer.decode(trained) == "A cat.<|im_end|>"
    picture = Image.open(root / "images" / image).convert("RGB")
    torch.testing.assert_close(sample["pixel_values"], _mindspeed_tiles(picture, 1, 6, TILE), atol=2e-6, rtol=0)


def test_placeholder_is_prepended_as_mindspeed_does(tiny):
    root, model = tiny
    splits, _, _ = _build(root, model, [_chat("wide.png", "What is this?", "A cat.")])
    _, _, ref = _reference(root, _chat("wide.png", "<image>\nWhat is this?", "A cat."))
    assert torch.equal(splits["train"][0]["input_ids"], ref["input_ids"][0])


def test_multi_turn_trains_every_answer(tiny):
    root, model = tiny
    record = _chat("odd.png", "<image>\nFirst?", "One.", "And then?", "Two, at last.")
    splits, _, _ = _build(root, model, [record])
    sample = splits["train"][0]
    processor, text, ref = _reference(root, record)
    assert torch.equal(sample["input_ids"], ref["input_ids"][0])
    ids, labels = _mindspeed_labels(processor, text, _tiles_per_image(root, record, 6))
    assert sample["labels"].tolist() == labels and sample["input_ids"].tolist() == ids
    trained = [t for t in sample["labels"].tolist() if t != -100]
    assert processor.tokenizer.decode(trained) == "One.<|im_end|>Two, at last.<|im_end|>"


def test_system_turn_of_the_record_replaces_the_template_one(tiny):
    root, model = tiny
    record = {
        "image": "square.png",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "<image>\nName it."},
            {"from": "gpt", "value": "cat"},
        ],
    }
    splits, _, _ = _build(root, model, [record])
    processor = load_internvl_processor(root / "model")
    text = processor.tokenizer.decode(splits["train"][0]["input_ids"])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<img><IMG_CONTEXT>")


def test_several_images_share_max_dynamic_patch(tiny):
    root, model = tiny
    record = _chat(["wide.png", "tall.png"], "<image>\nand <image>\nCompare.", "Different.")
    splits, _, _ = _build(root, model, [record])
    sample = splits["train"][0]
    processor, text, ref = _reference(root, record, max_patches=6)  # 3 tiles at most each, as MindSpeed MM
    assert torch.equal(sample["input_ids"], ref["input_ids"][0])
    assert torch.equal(sample["pixel_values"], ref["pixel_values"])
    tiles = _tiles_per_image(root, record, 6)
    assert tiles == [3, 4] and sample["pixel_values"].shape[0] == 7
    _, labels = _mindspeed_labels(processor, text, tiles)
    assert sample["labels"].tolist() == labels


def test_without_tiling_pad2square_then_one_tile(tiny):
    root, model = tiny
    record = _chat("odd.png", "<image>\nWhat?", "Noise.")
    splits, _, _ = _build(root, model, [record], _data_json(dynamic=False))
    sample = splits["train"][0]
    assert sample["pixel_values"].shape == (1, 3, TILE, TILE)
    picture = Image.open(root / "images" / "odd.png").convert("RGB")  # 100x40: padded to 100x100
    square = Image.new("RGB", (100, 100), tuple(int(x * 255) for x in MEAN))
    square.paste(picture, (0, 30))
    expected = _mindspeed_tiles(square.resize((TILE, TILE), Image.Resampling.BICUBIC), 1, 1, TILE)
    torch.testing.assert_close(sample["pixel_values"], expected, atol=2e-6, rtol=0)
    processor = load_internvl_processor(root / "model")
    ref = processor(
        text=processor.apply_chat_template(_messages(record), tokenize=False),
        images=[square],
        return_tensors="pt",
        crop_to_patches=False,
    )
    assert torch.equal(sample["pixel_values"], ref["pixel_values"])
    assert torch.equal(sample["input_ids"], ref["input_ids"][0])


def test_batch_of_different_tile_counts_and_a_forward_pass(tiny):
    from transformers import InternVLForConditionalGeneration

    root, model = tiny
    records = [
        _chat("square.png", "<image>\nA?", "one"),
        _chat("wide.png", "<image>\nB, longer question?", "two"),
        _chat("tall.png", "<image>\nC?", "three, the longest answer of all"),
        _chat("small.png", "D", "four"),
    ]
    splits, collate, _ = _build(root, model, records)
    data = splits["train"]
    samples = [data[i] for i in range(len(records))]
    tiles = [s["pixel_values"].shape[0] for s in samples]
    assert tiles == [1, 3, 5, 7]
    batch = collate(samples)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "pixel_values"}
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in samples]))
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        assert torch.equal(batch["input_ids"][i, :n], s["input_ids"]) and torch.equal(
            batch["labels"][i, :n], s["labels"]
        )
        assert (batch["input_ids"][i, n:] == model.pad_id).all() and (batch["labels"][i, n:] == -100).all()
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
    net = InternVLForConditionalGeneration.from_pretrained(root / "model").eval()
    features = net.get_image_features(
        pixel_values=batch["pixel_values"], vision_feature_layer=-1, vision_feature_select_strategy="default"
    ).pooler_output
    assert features.shape[0] * features.shape[1] == int((batch["input_ids"] == model.image_token_id).sum())
    assert features.shape[:2] == (sum(tiles), TOKENS_PER_TILE)
    out = net(**batch)
    assert torch.isfinite(out.loss)
    out.loss.backward()


def test_repeat_time(tiny):
    root, model = tiny
    records = [_chat("square.png", "<image>\nA?", str(i)) for i in range(4)]
    config = _data_json()
    config["dataset_param"]["basic_parameters"]["repeat_time"] = 2
    splits, _, _ = _build(root, model, records, config)
    assert len(splits["train"]) == 8
    config["dataset_param"]["basic_parameters"]["repeat_time"] = 0.5
    splits, _, reports = _build(root, model, records, config)
    assert len(splits["train"]) == 2 and reports["train"].total == 2


# ------------------------------------------------------------------------------------------------ bad records
BAD_RECORDS = [
    ('{"image": "square.png", "conversations": [', "not valid JSON"),
    (_chat("missing.png", "<image>\nA?", "b"), "image not found"),
    (_chat("../model/config.json", "<image>\nA?", "b"), "lies outside data_folder"),
    (_chat("square.png", "<image>\n<image>\nA?", "b"), "2 <image> placeholders for 1 images"),
    (_chat(["square.png", "wide.png"], "<image>\nA?", "b"), "1 <image> placeholders for 2 images"),
    (_chat("square.png", "<image>\nA\ud800?", "b"), "text the tokenizer cannot encode"),
    (_chat("square.png", "<image>\nA <IMG_CONTEXT>?", "b"), "special token '<IMG_CONTEXT>'"),
    (_chat("square.png", "<image>\nA?", "b <|im_end|>"), "special token '<|im_end|>'"),
    (_chat("square.png", "<image>\nA?", "b <image>"), "<image> in a gpt turn"),
    (
        {
            "video": "clip.mp4",
            "conversations": [{"from": "human", "value": "<video>\nA?"}, {"from": "gpt", "value": "b"}],
        },
        "video records are not supported",
    ),
    ({"conversations": [{"from": "human", "value": "A?"}, {"from": "gpt", "value": "b"}]}, "no `image`"),
    ({"image": "square.png", "conversations": [{"from": "human", "value": "<image>\nA?"}]}, "no gpt turn"),
    (
        {
            "image": "square.png",
            "conversations": [{"from": "user", "value": "<image>\nA?"}, {"from": "gpt", "value": "b"}],
        },
        "role 'user'",
    ),
    ([1, 2], "must be a JSON object"),
]


def test_bad_records_are_counted_with_file_and_line(tiny):
    root, model = tiny
    good = _chat("square.png", "<image>\nA?", "fine")
    lines = [good] + [line for line, _ in BAD_RECORDS] + [good]
    splits, _, reports = _build(root, model, lines)
    report = reports["train"]
    assert report.total == len(lines) and len(splits["train"]) == 2
    assert len(report.problems) == len(BAD_RECORDS)
    for number, ((_, why), problem) in enumerate(zip(BAD_RECORDS, report.problems), start=2):
        assert problem.startswith(f"train.jsonl:{number}: ") and why in problem, problem
    with pytest.raises(DataError, match="train.jsonl:2: not valid JSON"):
        _build(root, model, lines, strict=True)
    with pytest.raises(DataError, match="no usable record"):
        _build(root, model, [line for line, _ in BAD_RECORDS])


def test_a_record_failing_at_load_time_is_counted_and_replaced(tiny):
    root, model = tiny
    _picture(root / "images" / "gone.png", 56, 56, seed=3)
    records = [_chat("gone.png", "<image>\nA?", "lost"), _chat("square.png", "<image>\nB?", "kept")]
    splits, _, reports = _build(root, model, records)
    (root / "images" / "gone.png").unlink()
    with pytest.warns(UserWarning, match="train.jsonl:1"):
        sample = splits["train"][0]
    assert torch.equal(sample["input_ids"], splits["train"][1]["input_ids"])
    assert len(reports["train"].problems) == 1 and reports["train"].problems[0].startswith("train.jsonl:1: ")
    _picture(root / "images" / "gone.png", 56, 56, seed=3)
    splits, _, _ = _build(root, model, records, strict=True)
    (root / "images" / "gone.png").unlink()
    with pytest.raises(DataError, match="strict mode: train.jsonl:1"):
        splits["train"][0]


# ------------------------------------------------------------------------------------------------ bad keys
def _set(path: str, value):
    def change(config: dict) -> None:
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return change


def _both(*changes):
    def change(config: dict) -> None:
        for one in changes:
            one(config)

    return change


_DELETE = object()
_PIPE = "dataset_param.preprocess_parameters.train_pipeline.image"
BAD_KEYS = [
    (
        _set("dataset_param.max_dynamic_patchs", 6),
        r"unknown key `dataset_param.max_dynamic_patchs`; did you mean "
        r"`dataset_param.max_dynamic_patch`",
    ),
    (_set("dataset_param.repeat_time", 2), r"`dataset_param.repeat_time`: set it in `basic_parameters`"),
    (_set("dataset_param.basic_parameters.val_rate", 0.1), r"basic_parameters.val_rate`: MindSpeed MM splits"),
    (_set("dataset_param.basic_parameters.data_path", "nope.jsonl"), r"data_path`: file not found"),
    (_set("dataset_param.basic_parameters.data_path", "train.csv"), r"data_path`: 'train.csv': only .json"),
    (_set("dataset_param.basic_parameters.repeat_time", 1.5), r"repeat_time`: above 1 it must be a whole number"),
    (_set("dataset_param.basic_parameters.repeat_time", 0), r"repeat_time`: expected a positive number"),
    (_set("dataset_param.basic_parameters.data_storage_mode", "combine"), r"data_storage_mode`: only 'standard'"),
    (_set("dataset_param.dataset_type", "t2v"), r"dataset_type`: expected 'multimodal'"),
    (_set("dataset_param.template_name", "internvl25"), r"template_name`: unknown template 'internvl25'; did you"),
    (_set("dataset_param.template_name", "internvit_qwen3"), r"template_name`: 'internvit_qwen3' writes Qwen"),
    (_set("dataset_param.image_size", 0), r"`dataset_param.image_size`: expected a positive integer"),
    (
        _both(_set("dataset_param.image_size", 112), _set(f"{_PIPE}.1.param.size", [112, 112])),
        r"`dataset_param.image_size`: 112, but the image processor makes 56x56 tiles",
    ),
    (_set("dataset_param.patch_size", 7), r"`dataset_param.patch_size`: 7, but the model's"),
    (_set("dataset_param.down_sample_ratio", 0), r"down_sample_ratio`: expected a number in \(0, 1\]"),
    (_set("dataset_param.down_sample_ratio", 0.25), r"down_sample_ratio`: 0.25, but the model's downsample_ratio"),
    (_set("dataset_param.min_dynamic_patch", -1), r"min_dynamic_patch`: expected a positive integer"),
    (_set("dataset_param.min_dynamic_patch", 8), r"min_dynamic_patch`: 8 is larger than max_dynamic_patch 6"),
    (_set("dataset_param.use_thumbnail", False), r"use_thumbnail`: false is not supported with dynamic"),
    (_set("dataset_param.dynamic_image_size", "yes"), r"dynamic_image_size`: expected true or false"),
    (_set("dataset_param.max_num_frame", 2), r"min_num_frame`: 8 is larger than max_num_frame 2"),
    (_set("dataset_param.sampling_method", "random"), r"sampling_method`: expected 'rand', 'middle' or 'fps"),
    (_set(f"{_PIPE}.3.param.std", [0.229, 0, 0.225]), r"image.3.param.std`: a standard deviation of 0"),
    (_set(f"{_PIPE}.3.param.mean", [0.5, 0.5, 0.5]), r"norm_fun.mean`: \[0.5, 0.5, 0.5\], but the image processor"),
    (_set(f"{_PIPE}.1.param.size", [448, 448]), r"image.1.param.size`: expected \[56, 56\]"),
    (_set(f"{_PIPE}.1.trans_type", "RandomHorizontalFlip"), r"RandomHorizontalFlip is not reproduced"),
    (_set(f"{_PIPE}.1.trans_type", "Resise"), r"unknown transform 'Resise'; did you mean `Resize`"),
    (_set(f"{_PIPE}.2", {"trans_type": "norm_fun", "param": {"mean": MEAN, "std": STD}}), r"norm_fun after"),
    (_set(f"{_PIPE}.2.param", {"pic": 1}), r"unknown key `.*image.2.param.pic`"),
    (_set(f"{_PIPE}.0.param.mean", [2, 0, 0]), r"image.0.param.mean`: expected values in \[0, 1\]"),
    (_set("dataset_param.preprocess_parameters.image_reader_type", "cv2"), r"image_reader_type`: expected one of"),
    (_set("dataset_param.preprocess_parameters.train_pipeline.video", []), r"train_pipeline.video`: not used"),
    (_set("dataset_param.tokenizer_config.from_pretrained", "nowhere"), r"from_pretrained`: directory not found"),
    (_set("dataset_param.tokenizer_config.from_pretrained", "images"), r"from_pretrained`: .* has no config.json"),
    (_set("dataset_param.tokenizer_config.add_eos_token", True), r"add_eos_token`: only false"),
    (_set("dataset_param.tokenizer_config.hub_backend", "om"), r"hub_backend`: only 'hf'"),
    (_set("dataset_param.tokenizer_config.trust_remote_code", True), r"unknown key `.*tokenizer_config.trust_remote"),
    (_set("dataset_param.tokenizer_config", _DELETE), r"`dataset_param.tokenizer_config`: missing"),
    (_set("dataloader_param.collate_param.model_name", "qwen2vl"), r"model_name`: expected 'internvl'"),
    (_set("dataloader_param.collate_param.pad_id", 100000), r"pad_id`: 100000 is not below the vocabulary size"),
    (_set("dataloader_param.collate_param.pad_id", -1), r"pad_id`: expected a token id"),
    (_set("dataloader_param.collate_param.pad_idx", 0), r"unknown key `.*collate_param.pad_idx`; did you mean"),
]


@pytest.mark.parametrize("change, message", BAD_KEYS, ids=[m[:40] for _, m in BAD_KEYS])
def test_bad_keys_are_refused_by_name(tiny, change, message):
    root, model = tiny
    config = _data_json()
    config["dataloader_param"]["collate_param"]["pad_id"] = model.pad_id
    change(config)
    with pytest.raises(DataConfigError, match=rf"^{SOURCE}: .*{message}"):
        _build(root, model, [_chat("square.png", "<image>\nA?", "b")], config)


def test_bad_keys_without_tiling(tiny):
    root, model = tiny
    for change, message in [
        (_set(f"{_PIPE}.1", {"trans_type": "ToTensor"}), r"needs a Resize"),
        (
            _set(f"{_PIPE}.1.param.interpolation", "BILINEAR"),
            r"Resize's interpolation; the image processor "
            r"resamples with BICUBIC",
        ),
    ]:
        config = _data_json(dynamic=False)
        if "needs a Resize" in message:
            del config["dataset_param"]["preprocess_parameters"]["train_pipeline"]["image"][2]
        change(config)
        with pytest.raises(DataConfigError, match=message):
            _build(root, model, [_chat("square.png", "<image>\nA?", "b")], config)


def test_several_sources_and_paths_relative_to_base_dir(tiny, tmp_path):
    root, model = tiny
    (tmp_path / "more").mkdir()
    _picture(tmp_path / "more" / "x.png", 60, 30, seed=9)
    _write(tmp_path, [_chat("x.png", "<image>\nX?", "x"), _chat("x.png", "<image>\nY?", "y")], "more.jsonl")
    config = _data_json(model=str(root / "model"))
    first = {"data_path": str(root / "train.jsonl"), "data_folder": str(root / "images"), "repeat_time": 2}
    config["dataset_param"]["basic_parameters"] = [first, {"data_path": "more.jsonl", "data_folder": "more"}]
    config["dataloader_param"]["collate_param"]["pad_id"] = model.pad_id
    _write(root, [_chat("square.png", "<image>\nA?", "a")])
    splits, _, reports = build_multimodal_datasets(
        config["dataset_param"], config["dataloader_param"]["collate_param"], tmp_path, SOURCE, False
    )
    data = splits["train"]
    assert len(data) == 2 + 2 and reports["train"].total == 3
    processor = load_internvl_processor(root / "model")
    assert processor.tokenizer.decode(data[1]["labels"][data[1]["labels"] != -100]) == "a<|im_end|>"
    assert processor.tokenizer.decode(data[3]["labels"][data[3]["labels"] != -100]) == "y<|im_end|>"
    config["dataset_param"]["basic_parameters"][1]["data_folder"] = "absent"
    with pytest.raises(DataConfigError, match=r"basic_parameters.1.data_folder`: directory not found"):
        build_multimodal_datasets(
            config["dataset_param"], config["dataloader_param"]["collate_param"], tmp_path, SOURCE, False
        )


def test_a_model_directory_of_another_kind_is_refused(tiny, tmp_path):
    root, model = tiny
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    config = _data_json(model=str(other))
    with pytest.raises(DataConfigError, match=r"from_pretrained`: model_type is 'qwen2'; Transformers' InternVL"):
        _build(root, model, [_chat("square.png", "<image>\nA?", "b")], config)


def test_the_data_module_reads_a_multimodal_data_json(tiny, tmp_path, monkeypatch):
    """``MMDataModule(data_config=data.json)`` dispatches ``dataset_type: multimodal`` here, paths relative to the
    working directory (MindSpeed MM's examples run from its repository root), and its batches are the collate's."""
    from lightning_mm import MMDataModule

    root, model = tiny
    records = [_chat("square.png", "<image>\nA?", "one"), _chat("wide.png", "<image>\nB?", "two")]
    _write(root, [*records, _chat("missing.png", "<image>\nC?", "three")])
    config = _data_json(model=str(root / "model"))
    config["dataset_param"]["basic_parameters"].update(
        data_path=str(root / "train.jsonl"), data_folder=str(root / "images")
    )
    config["dataloader_param"]["collate_param"]["pad_id"] = model.pad_id
    config["dataloader_param"].update(shuffle=False, drop_last=False)
    (tmp_path / "data.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    data = MMDataModule(data_config="data.json", batch_size=2)
    # the bad record is reported, not dropped silently
    with pytest.warns(UserWarning, match=r"(?s)1 skipped.*train.jsonl:3: image not found"):
        data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    splits, collate, _ = _build(root, model, records)
    expected = collate([splits["train"][0], splits["train"][1]])
    assert set(batch) == set(expected)
    for key in expected:
        assert torch.equal(batch[key], expected[key]), key


def _image_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:  # closed at once (no unclosed-file ResourceWarning)
        return image.size
