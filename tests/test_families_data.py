"""MindSpeed MM ``dataset_type: huggingface`` data for more VLM families (``lightning_mm/testing/tiny_families.py``).

Each sample of a family with a MindSpeed MM template (GLM-4.1V, GLM-4.5V, Qwen2.5-Omni) is compared, bit for bit,
with MindSpeed MM's sample (``tests/helpers/mindspeed_reference.py``, a re-telling of its code). Each sample of a family
with its own chat template (Gemma 3, Idefics3: ``template: null``) is compared with what the model's own processor
gives for the same conversation through its own ``apply_chat_template(tokenize=True, return_dict=True)`` (input
ids, pixel values and every image metadata key), the images bounded as MindSpeed MM's ``BasePlugin`` bounds them;
the assistant-only labels are computed independently here: the processor's token ids are decoded back to the
expanded text (byte-level BPE decodes exactly), each assistant turn is found there by the family's turn markers, and
a token is trained when its first character lies inside an assistant turn. Then the collated batch runs forward and
backward through the model ``TransformersModel`` builds (no adapter: the derived one; the same loss as plain
Transformers), and the batch check accepts it and counts its images. Last, a 2-rank FSDP2 run on such batches
(``tests/scenarios/families_scenarios.py``: Gemma 3, GLM-4.1V, GLM-4.5V and the Qwen2.5-Omni thinker plain with
trainable towers, Gemma 3 with non-reentrant recomputation, GLM-4.1V with a frozen tower) is compared per step with
plain Transformers in one process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from lightning_mm import MMDataModule
from lightning_mm.data.data_config import DataConfigError
from lightning_mm.hf.batch_check import BatchCheckError, check_batch, expected_image_tokens, has_batch_check
from lightning_mm.hf.chat_collate import ChatCollator
from lightning_mm.modules import TransformersModel
from lightning_mm.testing.tiny_families import write_tiny_family
from tests.helpers.mindspeed_reference import reference as mindspeed_reference
from tests.scenarios.families_scenarios import CASES as PARITY_CASES

THOUGHT = "<think>\n\n</think>\n\n"  # the empty thought of MindSpeed MM's reasoning templates
# family -> MindSpeed template (None: the model's own chat template), how an assistant turn opens and closes in the
# rendered text (for the families with their own chat template).
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": dict(template=None, open="<start_of_turn>model\n", close="<end_of_turn>\n"),
    "idefics3": dict(template=None, open="Assistant:", close="<end_of_utterance>\n"),
    "glm4v": dict(template="glm4.1v", open="<|assistant|>\n", close="", thought=THOUGHT),
    "glm4v_moe": dict(template="glm4v_moe", open="<|assistant|>\n", close="", thought=THOUGHT),
    "qwen2_5_omni_thinker": dict(template="qwen2_omni", open="<|im_start|>assistant\n", close="<|im_end|>\n"),
}
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
MAX_PIXELS = 56 * 56
IMAGES = {"a.png": (60, 40), "b.png": (28, 84), "c.png": (90, 50), "d.png": (33, 47)}


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
        ],
        ["d.png"],
    ),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: write_tiny_family(root / family, family) for family in FAMILIES}


def _config(model: Path, family: str, basic: dict | None = None) -> dict:
    template = FAMILIES[family]["template"]
    return {
        "dataset_param": {
            "dataset_type": "huggingface",
            "preprocess_parameters": {
                "model_name_or_path": str(model),
                "use_fast_tokenizer": True,
                "split_special_tokens": False,
                "image_max_pixels": MAX_PIXELS,
                "image_min_pixels": 1024,
            },
            "basic_parameters": {
                "template": template,
                "dataset_dir": "./data",
                "dataset": "./data/train.jsonl",
                "train_on_prompt": False,
                "mask_history": False,
                **(basic or {}),
            },
            "attr": dict(ATTR),
        },
        "dataloader_param": {
            "dataloader_mode": "sampler",
            "drop_last": False,
            "sampler_type": "BaseRandomBatchSampler",
            "collate_param": {"model_name": "qwen2vl", "ignore_pad_token_for_loss": True},
            "pin_memory": False,
            "shuffle": False,
        },
    }


def _module(tmp: Path, monkeypatch, config: dict, records: list[dict] | None = None, **kwargs: Any) -> MMDataModule:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for i, (name, size) in enumerate(IMAGES.items()):
        g = torch.Generator().manual_seed(i)
        Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()).save(
            data / name
        )
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in (records or RECORDS)) + "\n")
    (tmp / "data.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp)
    module = MMDataModule(data_config=tmp / "data.json", **kwargs)
    module.setup()
    return module


# ----------------------------------------------------------------------------------------------- the reference
def _bounded(image: Image.Image) -> Image.Image:
    """MindSpeed MM's ``BasePlugin._preprocess_image`` (image_max_pixels, then image_min_pixels 1024)."""
    for limit, beyond in ((MAX_PIXELS, lambda a: a > MAX_PIXELS), (1024, lambda a: a < 1024)):
        area = image.width * image.height
        if beyond(area):
            f = math.sqrt(limit / area)
            image = image.resize((int(image.width * f), int(image.height * f)), resample=Image.Resampling.NEAREST)
    return image


def _reference_processor(model: Path) -> Any:
    """The model's processor; for a family whose video processor needs torchvision, its processor class built from
    the saved tokenizer, image processor and chat template, without a video processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(model)
    except ImportError:
        base = getattr(transformers, json.loads((model / "processor_config.json").read_text())["processor_class"])

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, name, argument):
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, argument)

    parts = {
        "image_processor": AutoImageProcessor.from_pretrained(model),
        "tokenizer": AutoTokenizer.from_pretrained(model),
        "video_processor": None,
    }
    if "feature_extractor" in base.get_attributes():
        parts["feature_extractor"] = transformers.WhisperFeatureExtractor.from_pretrained(model)
    return ImagesOnly(**parts, chat_template=(model / "chat_template.jinja").read_text())


def _reference(
    model: Path,
    family: str,
    record: dict,
    data: Path,
    *,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    enable_thinking: bool = True,
) -> dict[str, torch.Tensor]:
    spec = FAMILIES[family]
    if spec["template"] is not None:  # a MindSpeed MM template: its own sample (tests/helpers/mindspeed_reference.py)
        flags = dict(train_on_prompt=train_on_prompt, mask_history=mask_history, enable_thinking=enable_thinking)
        return mindspeed_reference(model, spec["template"], record, data, MAX_PIXELS, 1024, **flags)
    processor = _reference_processor(model)
    images = []
    for name in record.get("images", []):
        with Image.open(data / name) as img:
            images.append(_bounded(img.convert("RGB")))
    pending = iter(images)
    messages: list[dict[str, Any]] = []
    assistants = []
    for turn in record["messages"]:
        if turn["role"] == "user":
            parts: list[dict[str, Any]] = []
            for i, piece in enumerate(turn["content"].split("<image>")):
                parts += [{"type": "image", "image": next(pending)}] if i else []
                parts += [{"type": "text", "text": piece}] if piece else []
            messages.append({"role": "user", "content": parts})
        else:
            content = spec.get("thought", "") + turn["content"]
            messages.append(
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": content}] if family == "idefics3" else content,
                }
            )
            assistants.append((" " if family == "idefics3" else "") + content)
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    expanded = processor.tokenizer.decode(ids, skip_special_tokens=False)
    encoded = processor.tokenizer(expanded, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == ids, "the decoded text does not tokenize back to the processor's ids"
    spans, cursor = [], 0
    for content in assistants:
        start = expanded.index(spec["open"], cursor) + len(spec["open"])
        body = content + spec["close"]
        assert expanded[start : start + len(body)] == body
        thought = 0 if enable_thinking else len(spec.get("thought", ""))  # the empty thought is prompt then
        spans.append((start + thought, start + len(body)))
        cursor = start + len(body)
    trained = spans[-1:] if mask_history else spans
    labels = []
    for token, (s, _e) in zip(ids, encoded["offset_mapping"]):
        answer = any(a <= s < b for a, b in spans)
        keep = any(a <= s < b for a, b in trained) or (train_on_prompt and not answer)
        labels.append(token if keep else -100)
    sample = {
        k: v[0] if k in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids") else v
        for k, v in out.items()
    }
    sample["labels"] = torch.tensor(labels)
    return sample


def _assert_same(sample: dict, reference: dict) -> None:
    assert sorted(sample) == sorted(reference)
    for key, value in reference.items():
        assert sample[key].dtype == value.dtype, key
        assert torch.equal(sample[key], value), key


# ----------------------------------------------------------------------------------------------- samples
@pytest.mark.parametrize("family", list(FAMILIES))
def test_samples_equal_mindspeed_mms_or_the_model_chat_templates(family, models, tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch, _config(models[family], family), batch_size=3)
    dataset = module._splits["train"]
    for i, record in enumerate(RECORDS):
        sample = dataset[i]
        _assert_same(sample, _reference(models[family], family, record, tmp_path / "data"))
        assert (sample["labels"] != -100).any() and (sample["labels"] == -100).any()
    modes = [{"mask_history": True}, {"train_on_prompt": True}]
    modes += [{"enable_thinking": False}] if "thought" in FAMILIES[family] else []
    for flags in modes:
        flagged = _module(tmp_path, monkeypatch, _config(models[family], family, basic=flags))._splits["train"]
        _assert_same(flagged[2], _reference(models[family], family, RECORDS[2], tmp_path / "data", **flags))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_batch_trains_the_plain_model_and_passes_the_batch_check(family, models, tmp_path, monkeypatch):
    import transformers

    module = _module(tmp_path, monkeypatch, _config(models[family], family), batch_size=3)
    batch = next(iter(module.train_dataloader()))
    samples = [module._splits["train"][i] for i in range(3)]
    for row, sample in enumerate(samples):  # right padding, vision keys in sample order
        n = len(sample["input_ids"])
        assert torch.equal(batch["input_ids"][row, :n], sample["input_ids"])
        assert (batch["labels"][row, n:] == -100).all() and (batch["attention_mask"][row, n:] == 0).all()
    model = TransformersModel({"init_from_hf_path": str(models[family])}).train()  # no adapter: the derived one
    assert has_batch_check(model) and type(model).__name__ == "MM" + model.config.architectures[0]
    plain = getattr(transformers, model.config.architectures[0]).from_pretrained(models[family]).train()
    check_batch(model, batch)
    expected = expected_image_tokens(model, batch)  # the images are counted, not only seen
    assert expected is not None and expected == int((batch["input_ids"] == model.config.image_token_id).sum())
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and torch.allclose(loss, plain(**batch).loss, rtol=1e-6)
    vision = [p for n, p in model.named_parameters() if "vision" in n or "visual" in n]
    assert vision and sum(float(p.grad.abs().sum()) for p in vision if p.grad is not None) > 0  # images reach the loss
    dropped = {**batch, "pixel_values": batch["pixel_values"][:-1]}  # one image (or crop) less
    if "image_grid_thw" in batch:  # Qwen-VL-like: the last image's grid row and its patches
        last = int(batch["image_grid_thw"][-1].prod())
        dropped.update(pixel_values=batch["pixel_values"][:-last], image_grid_thw=batch["image_grid_thw"][:-1])
    with pytest.raises(BatchCheckError, match="image"):
        check_batch(model, dropped)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_family_refuses_a_template_of_another(family, models, tmp_path, monkeypatch):
    config = _config(models[family], family)
    config["dataset_param"]["basic_parameters"]["template"] = "qwen2vl"
    with pytest.raises(DataConfigError, match=f"template 'qwen2vl' is for .* but the model is '{family}'"):
        _module(tmp_path, monkeypatch, config)


# ----------------------------------------------------------------------------------------------- Mistral 3
def test_mistral3_takes_a_pixtral_batch_and_its_processor_is_refused_by_name(tmp_path, monkeypatch):
    """Transformers 5's PixtralProcessor cannot be imported without torchvision, so no Mistral 3 sample can be built
    here: the data path says so by name. The model side is checked with a batch laid out as MindSpeed MM's Pixtral
    plugin lays it out (``[IMG]`` per merged patch, rows ended by ``[IMG_BREAK]``, the last by ``[IMG_END]``), its
    pixels from Transformers' PIL Pixtral image processor, collated by the data path's collate function."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from lightning_mm.hf.chat_collate import ChatCollator
    from lightning_mm.hf.vlm_processor import ProcessorLoadError, load_vlm_processor

    model_dir = write_tiny_family(tmp_path / "mistral3", "mistral3")
    with pytest.raises(ProcessorLoadError, match="PixtralProcessor cannot be used without torchvision"):
        load_vlm_processor(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    images = PixtralImageProcessorPil.from_pretrained(model_dir)
    ids = tokenizer.convert_tokens_to_ids
    samples = []
    for size in ((60, 40), (28, 64)):
        pixels = images(Image.new("RGB", size, (200, 10, 10)), patch_size=16, return_tensors="pt")
        h, w = (int(v) // 16 for v in pixels["image_sizes"][0])
        image = ([ids("[IMG]")] * w + [ids("[IMG_BREAK]")]) * h
        image[-1] = ids("[IMG_END]")
        prompt = [
            ids("<s>"),
            ids("[INST]"),
            *image,
            *tokenizer.encode("What is it?", add_special_tokens=False),
            ids("[/INST]"),
        ]
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
    batch = ChatCollator(tokenizer.pad_token_id)(samples)
    assert batch["pixel_values"].shape[0] == 2 and batch["pixel_values"].shape[-2:] == (64, 64)  # padded to the most
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(model_dir).train()
    check_batch(model, batch)
    assert expected_image_tokens(model, batch) == int((batch["input_ids"] == model.config.image_token_id).sum())
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.vision_tower.patch_conv.weight.grad.abs().sum() > 0
    with pytest.raises(BatchCheckError, match="image"):
        check_batch(
            model, {**batch, "pixel_values": batch["pixel_values"][:1], "image_sizes": batch["image_sizes"][:1]}
        )


# ----------------------------------------------------------------------------------------------- 2-rank parity
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from tests.helpers.scenario_kit import run
    from tests.scenarios import families_scenarios

    out = tmp_path_factory.mktemp("families_parity")
    families_scenarios.prepare(out)
    run(families_scenarios.train, out, timeout=600)
    return out


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.name)
def test_two_rank_training_on_data_path_batches_equals_plain_transformers(trained, case):
    from tests import test_parity
    from tests.helpers.parity import global_losses, global_steps
    from tests.scenarios import families_scenarios

    families_scenarios.register(trained)
    part = test_parity._part(test_parity._ranks(trained, case.name), 0)
    assert (
        part[0]["plan"]["model_class"]
        == "MM" + json.loads((trained / "ckpts" / case.family / "config.json").read_text())["architectures"][0]
    )
    plan = part[0]["plan"]
    tower = families_scenarios.TOWERS[case.family]
    assert plan["ignored"] == ([tower] if case.freeze else [])  # a frozen tower is ignored, a trainable one wrapped
    assert any(u[0].startswith(tower + ".") for u in plan["units"]) != bool(case.freeze)
    assert bool(plan["recompute"]) == bool(case.fsdp2.get("recompute_modules"))
    final = torch.load(trained / f"{case.name}.pt", weights_only=True)
    test_parity._check(case, global_losses(part), final, global_steps(case, part), trained / "ckpts")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_batch_without_images_gets_a_masked_filler_image(family, models, tmp_path, monkeypatch):
    import transformers

    text_only = [
        _record([("user", "What is in this picture?"), ("assistant", "A red square.")]),
        _record([("user", "How many?"), ("assistant", "The answer is 2.")]),
    ]
    module = _module(tmp_path, monkeypatch, _config(models[family], family), batch_size=2, records=text_only)
    batch = next(iter(module.train_dataloader()))
    samples = [module._splits["train"][i] for i in range(2)]
    assert all("pixel_values" not in s for s in samples) and "pixel_values" in batch
    n = len(samples[0]["input_ids"])
    assert (batch["attention_mask"][0, n:] == 0).all() and (batch["labels"][0, n:] == -100).all()
    plain = ChatCollator(module._splits["train"].builder.tokenizer.pad_token_id)(samples)
    model = (
        getattr(transformers, json.loads((models[family] / "config.json").read_text())["architectures"][0])
        .from_pretrained(models[family])
        .eval()
    )
    check_batch(model, batch)
    with torch.no_grad():  # the filler runs the vision tower and changes no loss
        assert torch.allclose(model(**batch).loss, model(**plain).loss, rtol=1e-5)
