"""MindSpeed MM ``dataset_type: huggingface`` data configs through ``MMDataModule(data_config=...)``.

Each sample is compared, bit for bit, with MindSpeed MM's sample of the same record
(``tests/helpers/mindspeed_reference.py``, a re-telling of its code; more cases in ``tests/test_mindspeed_samples.py``)
on tiny Qwen2.5-VL and Qwen3-VL directories (``lightning_mm/testing/tiny_vlms.py``); a ``chat_template`` file's samples
with what the model's processor gives for that template (``apply_chat_template`` then ``processor(text=...,
images=...)``), the assistant-only labels computed independently here from the character offsets of the assistant
contents in the processor's (expanded) text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from lightning_mm import MMDataModule
from lightning_mm.data.data_config import DataConfigError
from lightning_mm.data.record_files import DataError
from lightning_mm.testing.tiny_vlms import FAMILIES, write_tiny_vlm
from tests.helpers.mindspeed_reference import reference as mindspeed_reference
from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import hfdata_scenarios

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = {"qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3_vl_nothink"}
COLLATE = {"qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl"}
ATTR = {
    "system": None,
    "images": "images",
    "videos": None,
    "messages": "messages",
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": None,
    "function_tag": None,
    "system_tag": None,
}
MAX_PIXELS = 56 * 56 * 2  # below the tiny image processors' own max_pixels (112 * 112), so the config decides


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {family: write_tiny_vlm(root / family, family) for family in TEMPLATE}


def _config(
    model: Path,
    family: str,
    template: str | None = None,
    basic: dict | None = None,
    loader: dict | None = None,
    pre: dict | None = None,
    **top: Any,
) -> dict:
    return {
        "dataset_param": {
            "dataset_type": "huggingface",
            "preprocess_parameters": {
                "model_name_or_path": str(model),
                "use_fast_tokenizer": True,
                "split_special_tokens": False,
                "image_max_pixels": MAX_PIXELS,
                "image_min_pixels": 0,
                "video_max_pixels": 16384,
                "video_min_pixels": 0,
                "video_fps": 2.0,
                "video_maxlen": 64,
                **(pre or {}),
            },
            "basic_parameters": {
                "template": template or TEMPLATE[family],
                "dataset_dir": "./data",
                "dataset": "./data/train.jsonl",
                "cache_dir": "./data/cache_dir",
                "train_on_prompt": False,
                "mask_history": False,
                "preprocessing_batch_size": 1000,
                "preprocessing_num_workers": 16,
                "max_samples": None,
                "tool_format": None,
                **(basic or {}),
            },
            "attr": dict(ATTR),
        },
        "dataloader_param": {
            "dataloader_mode": "sampler",
            "drop_last": False,
            "sampler_type": "BaseRandomBatchSampler",
            "collate_param": {"model_name": COLLATE[family], "ignore_pad_token_for_loss": True},
            "pin_memory": False,
            "shuffle": False,
            **(loader or {}),
        },
        **top,
    }


def _image(path: Path, size: tuple[int, int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)


def _record(turns: list[tuple[str, str]], images: list[str] | None = None) -> dict:
    record: dict[str, Any] = {"messages": [{"role": r, "content": c} for r, c in turns]}
    if images is not None:
        record["images"] = images
    return record


RECORDS = [
    _record([("user", "<image>What is in this picture?"), ("assistant", "A red square.")], ["a.png"]),
    _record([("user", "Two <image> and <image> shapes?"), ("assistant", "Yes, two.")], ["b.png", "c.png"]),
    _record(
        [
            ("user", "<image>Describe the image."),
            ("assistant", "Two cats."),
            ("user", "How many?"),
            ("assistant", "The answer is 2."),
            ("user", "Left or right?"),
            ("assistant", "left"),
        ],
        ["d.png"],
    ),
    _record([("user", "<image>How many?"), ("assistant", "One dog.")], ["big.png"]),  # above the pixel limit
]


def _write(tmp: Path, config: dict, records: list[dict] | None = None, name: str = "data.json") -> Path:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for i, (image, size) in enumerate(
        {"a.png": (60, 40), "b.png": (28, 84), "c.png": (90, 50), "d.png": (33, 47), "big.png": (300, 200)}.items()
    ):
        _image(data / image, size, i)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in (RECORDS if records is None else records)]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    path = tmp / name
    path.write_text(json.dumps(config))
    return path


def _module(tmp: Path, monkeypatch, config: dict, records: list[dict] | None = None, **kwargs) -> MMDataModule:
    monkeypatch.chdir(tmp)  # relative paths resolve against the working directory, as in MindSpeed MM
    module = MMDataModule(data_config=_write(tmp, config, records), **kwargs)
    module.setup()
    return module


# ----------------------------------------------------------------------------------------------- the reference
def _reference_processor(model: Path) -> Any:
    """The model's processor class, built from its saved parts (Transformers' Qwen-VL processors cannot load
    their video processor without torchvision, so it is left out)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    base = getattr(transformers, json.loads((model / "processor_config.json").read_text())["processor_class"])

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, name, argument):
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, argument)

    return ImagesOnly(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model),
        tokenizer=AutoTokenizer.from_pretrained(model),
        video_processor=None,
        chat_template=(model / "chat_template.jinja").read_text(),
    )


def _reference(
    model: Path,
    record: dict,
    data: Path,
    template: str | None = None,
    *,
    system: str | None = None,
    **flags: Any,
) -> dict[str, torch.Tensor]:
    """MindSpeed MM's sample (``tests/helpers/mindspeed_reference.py``, a re-telling of its code) for the family's
    template (:data:`TEMPLATE`, by the model's ``model_type``) or ``template``."""
    model_type = json.loads((model / "config.json").read_text())["model_type"]
    name = template or {**TEMPLATE, "qwen3_5": "qwen3_vl_nothink"}[model_type]
    record = dict(record, system=system) if system else record
    return mindspeed_reference(model, name, record, data, MAX_PIXELS, 0, **flags)


def _chat_template_reference(
    model: Path,
    record: dict,
    data: Path,
    *,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    thought: str = "",
    thought_trained: bool = True,
    system: str | None = None,
    chat_template: str | None = None,
) -> dict[str, torch.Tensor]:
    processor = _reference_processor(model)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    assistants = []
    for turn in record["messages"]:
        if turn["role"] == "user":
            parts = []
            for i, piece in enumerate(turn["content"].split("<image>")):
                parts += ([{"type": "image"}] if i else []) + ([{"type": "text", "text": piece}] if piece else [])
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": "assistant", "content": thought + turn["content"]})
            assistants.append(turn["content"])
    text = processor.apply_chat_template(messages, tokenize=False, chat_template=chat_template)
    images = []
    for name in record.get("images", []):
        with Image.open(data / name) as img:
            images.append(img.convert("RGB"))
    # The images of these records lie within the pixel bounds (MindSpeed MM's BasePlugin leaves them as they are);
    # the processor resizes them with its own settings.
    assert all(img.width * img.height <= MAX_PIXELS for img in images)
    out = processor(text=[text], images=images or None, return_tensors="pt")
    # Labels from character offsets: each assistant content and its "<|im_end|>\n", in the expanded text.
    merge = processor.image_processor.merge_size**2
    expanded = text
    for grid in out.get("image_grid_thw", []):
        expanded = expanded.replace("<|image_pad|>", "<|placeholder|>" * int(grid.prod() // merge), 1)
    expanded = expanded.replace("<|placeholder|>", "<|image_pad|>")
    spans, cursor = [], 0
    for content in assistants:
        start = expanded.index("<|im_start|>assistant\n", cursor) + len("<|im_start|>assistant\n")
        body = thought + content + "<|im_end|>\n"
        assert expanded[start : start + len(body)] == body
        spans.append((start if thought_trained else start + len(thought), start + len(body)))
        cursor = start + len(body)
    if mask_history:
        spans = spans[-1:]
    encoded = processor.tokenizer(expanded, return_offsets_mapping=True)
    assert encoded["input_ids"] == out["input_ids"][0].tolist()
    labels = [
        tok if train_on_prompt or any(a <= s < b for a, b in spans) else -100
        for tok, (s, _e) in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]
    if train_on_prompt and mask_history:  # prompts trained, earlier answers not
        labels = [
            tok if not any(a <= s < b for a, b in _all_spans(expanded, assistants, thought)[:-1]) else -100
            for tok, (s, _e) in zip(encoded["input_ids"], encoded["offset_mapping"])
        ]
    sample = {k: v[0] if v.dim() == 2 and k != "pixel_values" and k != "image_grid_thw" else v for k, v in out.items()}
    sample["labels"] = torch.tensor(labels)
    return sample


def _all_spans(expanded: str, assistants: list[str], thought: str) -> list[tuple[int, int]]:
    spans, cursor = [], 0
    for content in assistants:
        start = expanded.index("<|im_start|>assistant\n", cursor) + len("<|im_start|>assistant\n")
        spans.append((start, start + len(thought + content + "<|im_end|>\n")))
        cursor = spans[-1][1]
    return spans


def _assert_same(sample: dict, reference: dict) -> None:
    assert sorted(sample) == sorted(reference)
    for key, value in reference.items():
        assert sample[key].dtype == value.dtype, key
        assert torch.equal(sample[key], value), key


# ----------------------------------------------------------------------------------------------- samples
@pytest.mark.parametrize("family", list(TEMPLATE))
def test_samples_equal_mindspeed_mms(family, models, tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch, _config(models[family], family))
    dataset = module._splits["train"]
    assert len(dataset) == len(RECORDS)
    for i, record in enumerate(RECORDS):
        sample = dataset[i]
        _assert_same(sample, _reference(models[family], record, tmp_path / "data"))
        assert "mm_token_type_ids" in sample and (sample["mm_token_type_ids"] == 1).sum() > 0
        assert (sample["labels"] != -100).any()
    grids = [dataset[i]["image_grid_thw"] for i in range(len(RECORDS))]
    assert grids[1].shape[0] == 2 and not torch.equal(grids[1][0], grids[1][1])  # two images of different sizes
    patch = 14 if family == "qwen2_5_vl" else 16
    assert int(grids[3].prod()) * patch * patch <= MAX_PIXELS  # 300x200 resized within image_max_pixels
    assert int(grids[3].prod()) * patch * patch > MAX_PIXELS // 4


@pytest.mark.parametrize(
    "flags", [{"mask_history": True}, {"train_on_prompt": True}, {"train_on_prompt": True, "mask_history": True}]
)
def test_multi_turn_label_modes(flags, models, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    module = _module(tmp_path, monkeypatch, _config(models[family], family, basic=flags))
    for i in (0, 2):
        _assert_same(module._splits["train"][i], _reference(models[family], RECORDS[i], tmp_path / "data", **flags))


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_vl_template_adds_an_empty_thought(thinking, models, tmp_path, monkeypatch):
    family = "qwen3_vl"
    config = _config(models[family], family, template="qwen3_vl", basic={"enable_thinking": thinking})
    module = _module(tmp_path, monkeypatch, config)
    for i in (0, 2):
        reference = _reference(models[family], RECORDS[i], tmp_path / "data", "qwen3_vl", enable_thinking=thinking)
        _assert_same(module._splits["train"][i], reference)


def test_system_column_and_system_turn(models, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    config = _config(models[family], family)
    config["dataset_param"]["attr"].update(system="sys", system_tag="system")
    records = [
        {**RECORDS[0], "sys": "Be brief."},
        {"messages": [{"role": "system", "content": "Be brief."}, *RECORDS[0]["messages"]], "images": ["a.png"]},
    ]
    module = _module(tmp_path, monkeypatch, config, records)
    reference = _reference(models[family], RECORDS[0], tmp_path / "data", system="Be brief.")
    for i in range(2):
        _assert_same(module._splits["train"][i], reference)


def test_collate_pads_right_and_concatenates_images_for_the_model(models, tmp_path, monkeypatch):
    import transformers

    family = "qwen2_5_vl"
    module = _module(tmp_path, monkeypatch, _config(models[family], family), batch_size=3)
    batch = next(iter(module.train_dataloader()))
    samples = [module._splits["train"][i] for i in range(3)]
    width = max(len(s["input_ids"]) for s in samples)
    pad = _reference_processor(models[family]).tokenizer.pad_token_id
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        assert torch.equal(batch["input_ids"][row, :n], sample["input_ids"])
        assert (batch["input_ids"][row, n:] == pad).all() and (batch["labels"][row, n:] == -100).all()
        assert (batch["attention_mask"][row, n:] == 0).all() and (batch["mm_token_type_ids"][row, n:] == 0).all()
    assert batch["input_ids"].shape == (3, width)
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in samples]))
    assert torch.equal(batch["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in samples]))
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(models[family]).eval()
    with torch.no_grad():
        batched = model(**batch).logits
        for row, sample in enumerate(samples):  # each row as the model computes the sample alone
            alone = model(**{k: v.unsqueeze(0) if v.dim() == 1 else v for k, v in sample.items()}).logits[0]
            assert torch.allclose(batched[row, : len(alone)], alone, atol=1e-5)


@pytest.mark.parametrize("family", list(TEMPLATE))
def test_a_batch_without_images_gets_a_masked_filler_image(family, models, tmp_path, monkeypatch):
    import transformers

    records = [
        _record([("user", "What is in this picture?"), ("assistant", "A red square.")]),
        _record([("user", "How many?"), ("assistant", "The answer is 2.")]),
    ]
    module = _module(tmp_path, monkeypatch, _config(models[family], family), records, batch_size=2)
    batch = next(iter(module.train_dataloader()))
    samples = [module._splits["train"][i] for i in range(2)]
    for sample, record in zip(samples, records):
        _assert_same(sample, _reference(models[family], record, tmp_path / "data"))
    plain = _collate_reference(samples, _reference_processor(models[family]).tokenizer.pad_token_id)
    assert "pixel_values" not in plain and "pixel_values" in batch and batch["image_grid_thw"].shape == (1, 3)
    n = len(samples[0]["input_ids"])
    image_id = _reference_processor(models[family]).image_token_id
    extra = batch["input_ids"][0, n:][batch["attention_mask"][0, n:] == 0]
    # MindSpeed MM's filler: <|vision_start|>, the image tokens, <|vision_end|> (tests/test_mindspeed_samples.py)
    assert (batch["input_ids"][0, n + 1 : n + 1 + int(batch["image_grid_thw"].prod()) // 4] == image_id).all()
    assert (batch["attention_mask"][0, n:] == 0).all() and (batch["labels"][0, n:] == -100).all() and len(extra)
    cls = {
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    }[family]
    model = cls.from_pretrained(models[family]).eval()
    with torch.no_grad():
        assert torch.allclose(model(**batch).loss, model(**plain).loss, rtol=1e-6)


def test_ignore_pad_token_for_loss_false_pads_labels_with_the_pad_id(models, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    config = _config(
        models[family], family, loader={"collate_param": {"model_name": "qwen2vl", "ignore_pad_token_for_loss": False}}
    )
    module = _module(tmp_path, monkeypatch, config, batch_size=2)
    batch = next(iter(module.train_dataloader()))
    n = len(module._splits["train"][1]["input_ids"])
    pad = _reference_processor(models[family]).tokenizer.pad_token_id
    short = 0 if len(module._splits["train"][0]["input_ids"]) < n else 1
    assert (batch["labels"][short, -1] == pad).item()


def test_loader_settings_and_max_samples(models, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    config = _config(
        models[family],
        family,
        basic={"max_samples": 2},
        loader={"drop_last": True, "pin_memory": True, "shuffle": False},
    )
    module = _module(tmp_path, monkeypatch, config)
    assert len(module._splits["train"]) == 2 and module.reports["train"].total == 2
    assert (module.shuffle, module.drop_last, module.pin_memory) == (False, True, True)
    loader = module.train_dataloader()
    assert loader.drop_last and loader.pin_memory
    assert isinstance(loader.sampler, torch.utils.data.SequentialSampler)


def test_the_data_section_of_a_launch_yaml(models, tmp_path, monkeypatch):
    family = "qwen3_vl"
    section = _config(models[family], family)
    import yaml

    text = yaml.safe_dump(
        {
            "gpt_args": {"micro_batch_size": 1, "num_workers": 8, "seq_length": 1024},
            "data": section,
            "model": {"model_id": "qwen3_vl", "init_from_hf_path": "x"},
        }
    )
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, {})
    (tmp_path / "qwen3vl_full_sft.yaml").write_text(text)
    module = MMDataModule.from_config(tmp_path / "qwen3vl_full_sft.yaml")
    module.setup()
    _assert_same(module._splits["train"][0], _reference(models[family], RECORDS[0], tmp_path / "data"))


def test_no_effect_keys_are_logged(models, tmp_path, monkeypatch, caplog):
    family = "qwen2_5_vl"
    with caplog.at_level(logging.INFO, logger="lightning_mm"):
        _module(tmp_path, monkeypatch, _config(models[family], family))
    text = caplog.text
    for key in ("cache_dir", "preprocessing_batch_size", "preprocessing_num_workers"):
        assert f"{key}` has no effect here" in text, key


# ----------------------------------------------------------------------------------------------- bad records
BAD = [
    ("{not json", "not valid JSON"),
    (_record([("user", "<image>What?"), ("assistant", "A.")], ["missing.png"]), "missing.png"),
    (_record([("human", "<image>What?"), ("assistant", "A.")], ["a.png"]), "unknown role 'human'"),
    (_record([("user", "<image>What?")], ["a.png"]), "no 'assistant' turn"),
    (_record([("user", "<image><image>What?"), ("assistant", "A.")], ["a.png"]), "2 <image> placeholders for 1"),
    (_record([("user", "What?"), ("assistant", "A.")], ["a.png"]), "0 <image> placeholders for 1"),
    (_record([("user", "<image>What\ud800?"), ("assistant", "A.")], ["a.png"]), "not valid Unicode"),
    (_record([("user", "<video>What?"), ("assistant", "A.")]), "1 <video> placeholders for 0 videos"),
    (_record([("user", "<image>What?"), ("assistant", "A.")], ["../outside.png"]), "lies outside dataset_dir"),
    (_record([("assistant", "A."), ("user", "<image>What?")], ["a.png"]), "role out of order"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m for _, m in BAD])
def test_bad_records_are_counted_with_file_and_line(bad, message, models, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    _image(tmp_path / "outside.png", (30, 30), 9)
    module = _module(tmp_path, monkeypatch, _config(models[family], family), [RECORDS[0], bad, RECORDS[1]])
    report = module.reports["train"]
    assert (report.total, report.skipped, len(module._splits["train"])) == (3, 1, 2)
    assert report.problems[0].startswith("train.jsonl:2: ") and message in report.problems[0], report.problems
    monkeypatch.chdir(tmp_path)
    strict = _config(models[family], family, strict=True)
    with pytest.raises(DataError, match="train.jsonl:2"):
        MMDataModule(data_config=_write(tmp_path, strict, [RECORDS[0], bad])).setup()


def test_media_outside_dataset_dir_with_the_opt_out(models, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    _image(tmp_path / "outside.png", (60, 40), 0)
    record = _record([("user", "<image>What is in this picture?"), ("assistant", "A red square.")], ["../outside.png"])
    config = _config(models[family], family, allow_outside_data_root=True)
    module = _module(tmp_path, monkeypatch, config, [record])
    _assert_same(module._splits["train"][0], _reference(models[family], RECORDS[0], tmp_path / "data"))


def test_a_record_that_fails_at_load_time_is_replaced_and_counted(models, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    module = _module(tmp_path, monkeypatch, _config(models[family], family))
    (tmp_path / "data" / "b.png").write_bytes(b"gone")  # passed the up-front check, fails to decode now
    with pytest.warns(UserWarning, match="train.jsonl:2"):
        sample = module._splits["train"][1]
    _assert_same(sample, _reference(models[family], RECORDS[2], tmp_path / "data"))
    assert "train.jsonl:2: cannot process the record" in module.reports["train"].problems[-1]
    strict = _module(tmp_path, monkeypatch, _config(models[family], family, strict=True))
    (tmp_path / "data" / "b.png").write_bytes(b"gone")
    with pytest.raises(DataError, match="train.jsonl:2"):
        strict._splits["train"][1]


# ----------------------------------------------------------------------------------------------- bad configs
def _edit(config: dict, path: str, value: Any) -> dict:
    *parents, key = path.split(".")
    node = config
    for p in parents:
        node = node[p]
    node[key] = value
    return config


CONFIG_ERRORS = [
    ("dataloader_param.shufle", True, "unknown key `dataloader_param.shufle`; did you mean `dataloader_param.shuffle`"),
    ("dataset_param.basic_parameters.mask_histroy", True, "did you mean `dataset_param.basic_parameters.mask_history`"),
    ("dataset_param.attr.imges", "images", "did you mean `dataset_param.attr.images`"),
    ("dataset_param.basic_parameters.template", "qwen3_omni", "for a family not built in here; supported: qwen2vl"),
    ("dataset_param.basic_parameters.template", "mistral", "supported: qwen2vl, qwen3_vl, qwen3_vl_nothink"),
    ("dataset_param.basic_parameters.template", "qwen3_vl", "for qwen2_5_vl use qwen2vl"),
    ("dataloader_param.batch_size", 4, "MMDataModule(batch_size=...)"),
    ("dataloader_param.dataloader_mode", "base", "`dataloader_param.dataloader_mode`: 'base' is not supported"),
    ("dataloader_param.sampler_type", "LengthGroupedSampler", "is not supported"),
    ("dataloader_param.collate_param.model_name", "internvl", "does not fit a qwen2_5_vl model"),
    ("dataset_param.basic_parameters.stage", "rm", "only supervised fine-tuning"),
    ("dataset_param.basic_parameters.cutoff_len", 0, "expected an integer >= 1"),
    ("dataset_param.basic_parameters.chat_template", "missing.jinja", "file not found"),
    ("val_dataset_param", {}, "give the validation records as dataset_param.basic_parameters.val_dataset"),
    ("dataloader_param.collate_param.collator_id", "internvl", "does not fit a qwen2_5_vl model"),
    ("dataloader_param.collate_param.pad_to_multiple_of", 0, "expected a positive integer"),
    ("dataloader_param.num_workers", -1, "expected an integer >= 0"),
    ("dataset_param.basic_parameters.packing", True, "set `neat_packing: true`"),
    ("dataset_param.basic_parameters.neat_packing", True, "set `dataset_param.basic_parameters.cutoff_len`"),
    ("dataset_param.basic_parameters.streaming", True, "streaming is not supported"),
    ("dataset_param.preprocess_parameters.split_special_tokens", True, "must stay single tokens"),
    ("dataset_param.attr.audios", "audios", "audio is not supported"),
    ("dataset_param.dataset_type", "t2v", "not supported here (supported: huggingface, multimodal, feature)"),
    ("dataset_param.basic_parameters.train_on_prompt", "yes", "expected true or false"),
]


@pytest.mark.parametrize("key,value,message", CONFIG_ERRORS, ids=[f"{k}={v}" for k, v, _ in CONFIG_ERRORS])
def test_config_errors_name_the_file_and_key(key, value, message, models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, _edit(_config(models["qwen2_5_vl"], "qwen2_5_vl"), key, value))
    with pytest.raises(DataConfigError) as err:
        MMDataModule(data_config=path).setup()
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)


def test_neat_packing_packs_rows_of_up_to_cutoff_len_tokens(models, tmp_path, monkeypatch):
    """MindSpeed MM's ``neat_packing`` with ``cutoff_len`` -> MMDataModule(packing=True, max_tokens_per_rank)."""
    from lightning_mm.core.packed_rows import packed_lengths

    config = _config(models["qwen2_5_vl"], "qwen2_5_vl", basic={"neat_packing": True, "cutoff_len": 96})
    module = _module(tmp_path, monkeypatch, config)
    assert module.packing and module.max_tokens_per_rank == 96
    train = module._splits["train"]
    samples = [train[i]["input_ids"].tolist() for i in range(len(train))]
    rows = []
    for batch in module.train_dataloader():
        assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1 and batch["input_ids"].shape[1] <= 96
        ids, start = batch["input_ids"][0].tolist(), 0
        for n in packed_lengths(batch["position_ids"])[0]:
            rows.append(ids[start : start + n])
            start += n
    assert sorted(rows) == sorted(samples) and len(rows) > len(list(module.train_dataloader()))


def test_native_layout_is_detected_and_unchanged(tmp_path):
    from lightning_mm.mindspeed.mindspeed_data import read_data_file

    (tmp_path / "data.yaml").write_text("data_root: .\ntrain: train.jsonl\n")
    assert read_data_file(tmp_path / "data.yaml") is None


# ----------------------------------------------------------------------------------------------- 2 ranks
def _run_scenario(fn: Callable[[Path], None], outdir: Path) -> list[dict]:
    run(fn, outdir)
    return read_results(outdir, fn.scenario_name)


def _absolute(config: dict, tmp: Path) -> dict:
    config["dataset_param"]["basic_parameters"].update(
        dataset_dir=str(tmp / "data"), dataset=str(tmp / "data" / "train.jsonl")
    )
    return config


def test_shuffle_false_reaches_lightning_distributed_sampler(models, tmp_path):
    """2 ranks, MMFSDP2Strategy: each rank sees exactly the unshuffled DistributedSampler order."""
    family = "qwen2_5_vl"
    records = [_record([("user", f"<image>What is {i}?"), ("assistant", f"It is {i}.")], ["a.png"]) for i in range(6)]
    _write(tmp_path, _absolute(_config(models[family], family), tmp_path), records)
    ranks = _run_scenario(hfdata_scenarios.order, tmp_path)
    for rank in ranks:
        assert rank["sampler"] == "DistributedSampler" and rank["shuffle"] is False
        assert rank["seen"] == rank["expected"] and len(rank["seen"]) == 3
    assert ranks[0]["seen"] != ranks[1]["seen"]


def test_the_dataset_survives_pickling_for_spawned_workers(models, tmp_path, monkeypatch):
    import pickle

    family = "qwen2_5_vl"
    dataset = _module(tmp_path, monkeypatch, _config(models[family], family))._splits["train"]
    _assert_same(pickle.loads(pickle.dumps(dataset))[1], dataset[1])


# Records 1 and 3 have no image: rank 1's first batch is text only (the collate function's filler image keeps
# its vision blocks' collectives in step with rank 0's).
PARITY_RECORDS = [
    _record([("user", f"<image>{q}" if image else q), ("assistant", a)], [image] if image else None)
    for q, a, image in [
        ("What is in this picture?", "A red square.", "a.png"),
        ("Describe the image.", "Two cats.", None),
        ("How many?", "The answer is 2.", "c.png"),
        ("Left or right?", "left", None),
        ("What colour?", "Blue ground.", "big.png"),
        ("Is it a dog?", "No, it is not.", "a.png"),
        ("Top or bottom?", "top", "c.png"),
        ("Shapes?", "One dog and two cats.", "b.png"),
    ]
]


def _collate_reference(samples: list[dict], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(s["input_ids"]) for s in samples)
    batch = {}
    for key, fill in (("input_ids", pad), ("attention_mask", 0), ("mm_token_type_ids", 0), ("labels", -100)):
        batch[key] = torch.stack(
            [torch.nn.functional.pad(s[key], (0, width - len(s[key])), value=fill) for s in samples]
        )
    if any("pixel_values" in s for s in samples):
        batch["pixel_values"] = torch.cat([s["pixel_values"] for s in samples if "pixel_values" in s])
        batch["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in samples if "pixel_values" in s])
    return batch


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_two_rank_training_equals_plain_transformers(tmp_path, family):
    """TransformersModel under MMFSDP2Strategy on 2 ranks, fed by a MindSpeed MM data.json, against one process
    of plain Transformers (same AdamW, the same global batches in the unshuffled sampler order): per-step losses
    at fp32 relative 1e-5."""
    import transformers

    model_dir = write_tiny_vlm(tmp_path / "model", family, seed=3, init_std=0.3)  # positions matter
    _write(tmp_path, _absolute(_config(model_dir, family), tmp_path), PARITY_RECORDS)
    ranks = _run_scenario(hfdata_scenarios.parity, tmp_path)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_class = getattr(transformers, FAMILIES[family]["model"])
        model = model_class.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
        pad = _reference_processor(model_dir).tokenizer.pad_token_id
        samples = [_reference(model_dir, r, tmp_path / "data") for r in PARITY_RECORDS]
        order = [list(range(rank, len(samples), 2)) for rank in range(2)]  # DistributedSampler, shuffle=False
        expected: list[list[float]] = [[], []]
        for step in range(3):  # two batches per epoch; the second epoch repeats the unshuffled order
            optimizer.zero_grad()
            first = 2 * (step % 2)
            for rank in range(2):
                batch = _collate_reference([samples[i] for i in order[rank][first : first + 2]], pad)
                assert [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])] == ranks[
                    rank
                ]["rows"][step]
                loss = model(**batch).loss
                (loss / 2).backward()  # FSDP averages the ranks' gradients
                expected[rank].append(float(loss.detach()))
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        got = torch.tensor(ranks[rank]["losses"], dtype=torch.float64)
        want = torch.tensor(expected[rank], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (rank, got.tolist(), want.tolist())
    assert expected[0][0] != expected[0][2]  # the weights moved


LAUNCH_YAML = """\
HF_MODEL_LOAD_PATH: &HF_MODEL_LOAD_PATH {model}
DATASET_PATH: &DATASET_PATH ./data/train.jsonl
SAVE_PATH: &SAVE_PATH save_dir

### GPT args
gpt_args:
  micro_batch_size: 1
  global_batch_size: 8  # 默认8卡配置
  seq_length: 1024
  num_workers: 8

### 数据相关配置
data:
  dataset_param:
    dataset_type: huggingface
    #数据集属性
    attr:
      system: null
      images: images
      videos: null
      messages: messages
      role_tag: role
      content_tag: content
      user_tag: user
      assistant_tag: assistant
      observation_tag: null
      function_tag: null
      system_tag: null

    # 数据预处理
    preprocess_parameters:
      model_name_or_path: *HF_MODEL_LOAD_PATH
      use_fast_tokenizer: true
      split_special_tokens: false
      image_max_pixels: {max_pixels}
      image_min_pixels: 1024
      video_max_pixels: 16384
      video_min_pixels: 0
      video_fps: 2.0
      video_maxlen: 64

    basic_parameters:
      template: qwen3_vl_nothink
      enable_thinking: false
      train_on_prompt: false
      mask_history: false
      tool_format: null
      dataset_dir: ./data
      dataset: *DATASET_PATH
      cache_dir: ./data/cache_dir
      overwrite_cache: false
      preprocessing_batch_size: 1000
      preprocessing_num_workers: 16
      max_samples: null

  # 数据加载
  dataloader_param:
    pin_memory: true
    shuffle: true
    dataloader_mode: sampler
    drop_last: true
    sampler_type: BaseRandomBatchSampler
    collate_param:
      model_name: qwen3vl
      ignore_pad_token_for_loss: true

### 模型相关配置
model:
  model_id: qwen3_vl
  init_from_hf_path: *HF_MODEL_LOAD_PATH
  image_encoder:
    vision_encoder:
      model_id: qwen3vit
      freeze: true
"""


def test_a_copy_of_mindspeed_qwen3vl_launch_yaml(models, tmp_path, monkeypatch):
    """The layout of MindSpeed MM's examples/qwen3vl/qwen3vl_full_sft_8B.yaml (anchors, comments, other sections),
    run from a directory that is not the config's: relative paths follow the working directory."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, {})
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "qwen3vl_full_sft_8B.yaml"
    path.write_text(LAUNCH_YAML.format(model=models["qwen3_vl"], max_pixels=MAX_PIXELS), encoding="utf-8")
    module = MMDataModule.from_config(path)
    module.setup()
    assert (module.shuffle, module.drop_last, module.pin_memory) == (True, True, True)
    sample = module._splits["train"][0]
    reference = _reference(models["qwen3_vl"], RECORDS[0], tmp_path / "data")
    # image_min_pixels 1024 is above a patch cell here, so the reference differs only if an image is that small
    _assert_same(sample, reference)


def test_val_dataset_and_val_max_samples(models, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    config = _config(models[family], family, basic={"val_dataset": "./data/train.jsonl", "val_max_samples": 3})
    module = _module(tmp_path, monkeypatch, config)
    assert len(module._splits["val"]) == 3 and module.reports["val"].total == 3 and module._splits["test"] is None
    _assert_same(module._splits["val"][2], _reference(models[family], RECORDS[2], tmp_path / "data"))


def test_llava_fixture_loads_and_its_family_is_refused_by_name(tmp_path, monkeypatch):
    """The tiny LLaVA directory loads with AutoProcessor (no video processor) and trains a step's loss; MindSpeed MM
    has no huggingface template for LLaVA, so a data config naming one is an error listing the supported ones."""
    import transformers

    model = write_tiny_vlm(tmp_path / "llava", "llava")
    processor = transformers.AutoProcessor.from_pretrained(model, local_files_only=True, trust_remote_code=False)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    assert text == "USER: <image>\nWhat is this? ASSISTANT: A red square. "
    out = processor(text=[text], images=[Image.new("RGB", (60, 40))], return_tensors="pt")
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 4
    loss = transformers.LlavaForConditionalGeneration.from_pretrained(model)(**out, labels=out["input_ids"]).loss
    assert torch.isfinite(loss)
    for template, message in (("llava", "not a MindSpeed MM template"), ("qwen2vl", "but the model is 'llava'")):
        monkeypatch.chdir(tmp_path)
        config = _config(model, "qwen2_5_vl", template=template)
        with pytest.raises(DataConfigError, match=message):
            MMDataModule(data_config=_write(tmp_path, config)).setup()


def test_mindspeed_fsdp_trainer_keys(models, tmp_path, monkeypatch):
    """Keys of MindSpeed MM's FSDP trainer configs (e.g. examples/qwen3_5/*_config.yaml): num_workers and
    enable_preload in dataloader_param, collator_id and pad_to_multiple_of, no template (the model's own)."""
    family = "qwen2_5_vl"
    config = _config(
        models[family],
        family,
        loader={
            "num_workers": 2,
            "enable_preload": False,
            "collate_param": {"collator_id": "qwen2vl", "ignore_pad_token_for_loss": True, "pad_to_multiple_of": 8},
        },
    )
    del config["dataset_param"]["basic_parameters"]["template"]
    config["dataset_param"]["basic_parameters"]["stage"] = "sft"
    module = _module(tmp_path, monkeypatch, config, batch_size=2)
    assert module.num_workers == 2
    assert MMDataModule(data_config=tmp_path / "data.json", num_workers=0).num_workers == 0  # the argument wins
    _assert_same(module._splits["train"][0], _reference(models[family], RECORDS[0], tmp_path / "data"))
    module.num_workers = 0
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape[1] % 8 == 0
    assert batch["input_ids"].shape[1] - max(len(module._splits["train"][i]["input_ids"]) for i in range(2)) < 8


def test_chat_template_file_replaces_the_models(models, tmp_path, monkeypatch):
    from lightning_mm.testing.tiny_vlms import QWEN2_5_VL_CHAT_TEMPLATE

    family = "qwen2_5_vl"
    custom = QWEN2_5_VL_CHAT_TEMPLATE.replace("You are a helpful assistant.", "You are a tiny model.")
    (tmp_path / "custom.jinja").write_text(custom)
    config = _config(models[family], family, basic={"chat_template": "./custom.jinja"})
    module = _module(tmp_path, monkeypatch, config)
    for i in (0, 2):
        _assert_same(
            module._splits["train"][i],
            _chat_template_reference(models[family], RECORDS[i], tmp_path / "data", chat_template=custom),
        )


def test_cutoff_len_cuts_each_turn_and_refuses_to_cut_an_image(models, tmp_path, monkeypatch):
    """MindSpeed MM cuts each turn's prompt and answer in proportion (infer_seqlen), not the sample at its end; a cut
    through an image's tokens is refused here (MindSpeed MM would build a sample the model rejects)."""
    family = "qwen2_5_vl"
    _write(tmp_path, {})
    late_image = _record(
        [
            ("user", "What is in this picture? Describe the image, left or right? <image>Describe."),
            ("assistant", "Two cats."),
            ("user", "How many?"),
            ("assistant", "The answer is 2."),
        ],
        ["d.png"],
    )
    full = _reference(models[family], late_image, tmp_path / "data")
    text_only = _record([("user", "Hi"), ("assistant", "No.")])
    short = _reference(models[family], text_only, tmp_path / "data")
    image_end = int(torch.nonzero(full["mm_token_type_ids"]).max())
    assert len(short["input_ids"]) <= image_end < len(full["input_ids"]) - 5
    cut = len(full["input_ids"]) - 5
    module = _module(
        tmp_path, monkeypatch, _config(models[family], family, basic={"cutoff_len": cut}), [late_image, text_only]
    )
    sample = module._splits["train"][0]
    _assert_same(sample, _reference(models[family], late_image, tmp_path / "data", cutoff_len=cut))
    assert not torch.equal(sample["labels"], full["labels"][: len(sample["labels"])])  # not cut at its end
    config = _config(models[family], family, basic={"cutoff_len": image_end})
    module = _module(tmp_path, monkeypatch, config, [late_image, text_only])
    with pytest.warns(UserWarning, match="train.jsonl:1: .*cuts the sample through its images' tokens"):
        replaced = module._splits["train"][0]
    _assert_same(replaced, short)  # the next good record takes its place


def test_installs_distributed_sampler_reads_the_trainer():
    import lightning as L

    from lightning_mm import _compat

    assert _compat.installs_distributed_sampler(L.Trainer(accelerator="cpu", devices=1, logger=False)) is False
    with pytest.raises(_compat.PrivateAPIError, match="use_distributed_sampler"):
        _compat.installs_distributed_sampler(object())
