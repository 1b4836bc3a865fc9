"""MMDataModule: providers, datasets, and the native data config on small real files (no processes)."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from lightning_mm import MMDataModule
from lightning_mm.data.data_config import DataConfigError
from lightning_mm.data.record_files import DataError


# ------------------------------------------------------------------------------------------- providers
def tensors(n):
    return TensorDataset(torch.arange(n).float())


def test_provider_returning_datasets_with_a_none_split():
    dm = MMDataModule(
        train_valid_test_datasets_provider=lambda: (tensors(10), tensors(4), None), batch_size=3, shuffle=False
    )
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert [len(b[0]) for b in batches] == [3, 3, 3, 1]
    assert len(list(dm.val_dataloader())) == 2
    assert dm.test_dataloader() == []


def test_provider_returning_dataloaders_uses_them_as_they_are():
    loader = DataLoader(tensors(6), batch_size=2)
    dm = MMDataModule(train_valid_test_datasets_provider=lambda: (loader, None, None), batch_size=2)
    dm.setup("fit")
    assert dm.train_dataloader() is loader and dm.val_dataloader() == []


def test_provider_by_import_path_and_bad_returns():
    dm = MMDataModule(
        train_valid_test_datasets_provider="examples.migration.pretrain_custom.train_valid_test_datasets_provider"
    )
    dm.setup("fit")
    assert isinstance(dm.train_dataloader(), DataLoader)
    with pytest.raises(TypeError, match=r"must return \(train, valid, test\)"):
        MMDataModule(train_valid_test_datasets_provider=lambda: tensors(3)).setup("fit")
    with pytest.raises(ValueError, match="no training split"):
        dm = MMDataModule(train_valid_test_datasets_provider=lambda: (None, tensors(3), None))
        dm.setup("fit")
        dm.train_dataloader()
    with pytest.raises(ImportError, match="no attribute"):
        MMDataModule(train_valid_test_datasets_provider="examples.migration.pretrain_custom.nope")


def test_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one"):
        MMDataModule()
    with pytest.raises(ValueError, match="exactly one"):
        MMDataModule(train_valid_test_datasets_provider=lambda: (None, None, None), train_dataset=tensors(2))


def test_seeded_shuffle_is_reproducible():
    def order(seed):
        dm = MMDataModule(train_dataset=tensors(20), batch_size=20, seed=seed)
        return next(iter(dm.train_dataloader()))[0].tolist()

    assert order(1) == order(1) and order(1) != order(2)


# ----------------------------------------------------------------------------------------- data config
def make_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]", "a", "red", "blue", "square", "circle", "what", "is", "it"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    ).save_pretrained(str(directory))


@pytest.fixture
def dataset_dir(tmp_path):
    (tmp_path / "img").mkdir()
    for name, color in (("r.png", (255, 0, 0)), ("b.png", (0, 0, 255))):
        Image.new("RGB", (20, 12), color).save(tmp_path / "img" / name)
    (tmp_path / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    make_tokenizer(tmp_path / "tok")
    return tmp_path


def write_config(root: Path, train_lines: list, **extra) -> Path:
    (root / "train.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in train_lines))
    config = {
        "data_root": ".",
        "train": "train.jsonl",
        "preprocess": {"tokenizer": "tok", "image_size": 8, "max_length": 7, "truncation": False},
        "loader": {"batch_size": 2, "shuffle": False},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    path = root / "data.json"
    path.write_text(json.dumps(config))
    return path


GOOD = [
    {"image": "img/r.png", "text": "a red square"},
    {
        "image": "img/b.png",
        "conversations": [{"from": "human", "value": "<image>\nwhat is it"}, {"from": "gpt", "value": "a blue circle"}],
    },
]


def test_happy_path_real_images_tokens_and_labels(dataset_dir):
    dm = MMDataModule.from_config(write_config(dataset_dir, GOOD))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape == (2, 3, 8, 8)
    assert batch["images"][0, 0].mean() > 0.9 and batch["images"][0, 2].mean() < -0.9  # red, normalised
    # caption: a red square [EOS] (+pad); conversation: prompt "what is it" masked, then "a blue circle [EOS]"
    assert batch["input_ids"][0].tolist() == [3, 4, 6, 2, 0, 0, 0]
    assert batch["labels"][0].tolist() == [3, 4, 6, 2, -100, -100, -100]
    assert batch["input_ids"][1].tolist() == [8, 9, 10, 3, 5, 7, 2]
    assert batch["labels"][1].tolist() == [-100, -100, -100, 3, 5, 7, 2]
    assert batch["attention_mask"].sum(1).tolist() == [4, 7]
    assert dm.reports["train"].skipped == 0


def test_native_config_packed_token_budget_batches(dataset_dir):
    """packing=True: the two samples (4 and 7 tokens) in one row of at most 11 tokens, images stacked."""
    dm = MMDataModule.from_config(write_config(dataset_dir, GOOD), packing=True, max_tokens_per_rank=11)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 1 and "attention_mask" not in batches[0]
    batch = batches[0]
    assert batch["images"].shape == (2, 3, 8, 8)
    assert batch["input_ids"].tolist() == [[8, 9, 10, 3, 5, 7, 2, 3, 4, 6, 2]]  # longest first (first-fit)
    assert batch["labels"].tolist() == [[-100, -100, -100, 3, 5, 7, 2, -100, 4, 6, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]]
    with pytest.raises(ValueError, match="batch_size or max_tokens_per_rank"):
        MMDataModule.from_config(write_config(dataset_dir, GOOD), batch_size=2, max_tokens_per_rank=11)
    with pytest.raises(ValueError, match="packing=True needs max_tokens_per_rank"):
        MMDataModule.from_config(write_config(dataset_dir, GOOD), packing=True)


def test_token_budget_batches_under_a_single_device_trainer(dataset_dir):
    """A single-device strategy has no distributed_sampler_kwargs: the loader plans for one rank."""
    import lightning as L

    dm = MMDataModule.from_config(write_config(dataset_dir, GOOD), packing=True, max_tokens_per_rank=11)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    trainer.datamodule = dm
    dm.trainer = trainer
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert (loader.world_size, loader.rank) == (1, 0) and len(loader) == 1


BAD = [
    ("{not json", "train.jsonl:3: not valid JSON"),
    ('["a list"]', "train.jsonl:3: a record must be a JSON object"),
    ({"text": "a red square"}, "train.jsonl:3: missing or non-string `image`"),
    ({"image": "img/r.png"}, "train.jsonl:3: record needs `text` or `conversations`"),
    ({"image": "img/gone.png", "text": "a red square"}, "train.jsonl:3: image not found"),
    ({"image": "img/broken.png", "text": "a red square"}, "train.jsonl:3: cannot read image"),
    ({"image": "img/r.png", "text": "   "}, "train.jsonl:3: empty text"),
    ({"image": "img/r.png", "text": "a red red red red red square"}, "train.jsonl:3: text is 8 tokens"),
    ({"image": "img/r.png", "conversations": [{"from": "robot", "value": "x"}]}, "unknown conversation role"),
    # A lone surrogate (JSON's "\ud800" escape) crashed the tokenizer with a TypeError and no file:line.
    ({"image": "img/r.png", "text": "a red \ud800 square"}, "train.jsonl:3: text is not valid Unicode (lone surrogate"),
    (
        {
            "image": "img/r.png",
            "conversations": [
                {"from": "human", "value": "<image>\nwhat \udfff"},
                {"from": "gpt", "value": "a red square"},
            ],
        },
        "train.jsonl:3: text is not valid Unicode",
    ),
    # One image, so at most one placeholder.
    (
        {
            "image": "img/r.png",
            "conversations": [
                {"from": "human", "value": "<image><image><image>\nwhat is it"},
                {"from": "gpt", "value": "a red square"},
            ],
        },
        "train.jsonl:3: 3 `<image>` placeholders for one image",
    ),
    (
        {
            "image": "img/r.png",
            "conversations": [
                {"from": "human", "value": "<image>\nwhat is it"},
                {"from": "gpt", "value": "a red <image> square"},
            ],
        },
        "train.jsonl:3: 2 `<image>` placeholders for one image",
    ),
]


@pytest.mark.parametrize(("line", "message"), BAD)
def test_bad_records_are_skipped_counted_and_reported_or_raise_in_strict_mode(dataset_dir, line, message):
    path = write_config(dataset_dir, [*GOOD, line])
    dm = MMDataModule.from_config(path)
    with pytest.warns(UserWarning, match="1 skipped"):
        dm.setup("fit")
    report = dm.reports["train"]
    assert report.total == 3 and report.skipped == 1 and message in report.problems[0]
    assert len(dm.train_dataloader().dataset) == 2
    strict = MMDataModule.from_config(write_config(dataset_dir, [*GOOD, line], strict=True))
    with pytest.raises(DataError, match=message.split(": ", 1)[0]):
        strict.setup("fit")


def test_truncation_keeps_overlong_text_and_counts_it(dataset_dir):
    line = {"image": "img/r.png", "text": "a red red red red red square"}
    dm = MMDataModule.from_config(write_config(dataset_dir, [line], preprocess={"truncation": True}))
    dm.setup("fit")
    assert dm.reports["train"].truncated == 1 and dm.reports["train"].skipped == 0
    assert len(dm.train_dataloader().dataset[0]["input_ids"]) == 7


def test_no_usable_record_is_an_error(dataset_dir):
    dm = MMDataModule.from_config(write_config(dataset_dir, [{"image": "img/gone.png", "text": "a"}]))
    with pytest.raises(DataError, match="no usable record"), pytest.warns(UserWarning):
        dm.setup("fit")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"trian": "train.jsonl"}, "unknown key `trian`; did you mean `train`"),
        ({"preprocess": {"max_len": 3}}, "unknown key `preprocess.max_len`; did you mean `preprocess.max_length`"),
        ({"loader": {"batchsize": 3}}, "did you mean `loader.batch_size`"),
        ({"val": "missing.jsonl"}, "`val`: file not found"),
        ({"data_root": "nowhere"}, "`data_root`: directory not found"),
        ({"preprocess": {"tokenizer": "no_tok"}}, "`preprocess.tokenizer`: not found"),
        ({"loader": {"batch_size": 0}}, "`loader.batch_size`: expected a positive integer"),
        ({"loader": {"padding": "left"}}, "`loader.padding`"),
        ({"strict": "yes"}, "`strict`"),
        # Values that make every sample NaN or infinite, or sizes that cannot be.
        ({"preprocess": {"image_std": [0, 0, 0]}}, "`preprocess.image_std`: a standard deviation of 0"),
        ({"preprocess": {"image_std": [0.5, 0.0, 0.5]}}, "`preprocess.image_std`: a standard deviation of 0"),
        ({"preprocess": {"image_std": [0.5, "inf", 0.5]}}, "`preprocess.image_std`: expected finite numbers"),
        ({"preprocess": {"image_mean": ["nan", 0.5, 0.5]}}, "`preprocess.image_mean`: expected finite numbers"),
        ({"preprocess": {"image_size": 0}}, "`preprocess.image_size`: expected a positive integer"),
        ({"preprocess": {"image_size": -8}}, "`preprocess.image_size`: expected a positive integer"),
        ({"preprocess": {"max_length": 0}}, "`preprocess.max_length`: expected a positive integer"),
        ({"loader": {"batch_size": -1}}, "`loader.batch_size`: expected a positive integer"),
    ],
)
def test_config_errors_name_the_key_before_training(dataset_dir, extra, message):
    with pytest.raises((DataConfigError, FileNotFoundError), match=message.replace("(", r"\(")) as err:
        MMDataModule.from_config(write_config(dataset_dir, GOOD, **extra))
    if err.type is DataConfigError:
        assert str(err.value).startswith(str(dataset_dir / "data.json"))  # the file, then the key


def test_a_processor_that_normalises_by_zero_is_a_config_error_naming_its_file(dataset_dir):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    CLIPImageProcessorPil(
        image_std=[0.5, 0, 0.5], size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}
    ).save_pretrained(str(dataset_dir / "proc"))
    dm = MMDataModule.from_config(write_config(dataset_dir, GOOD, preprocess={"processor": "proc"}))
    with pytest.raises(DataConfigError, match=r"proc: image processor `image_std` is \[0.5, 0, 0.5\]"):
        dm.setup("fit")


def test_any_exception_while_tokenizing_one_record_is_a_bad_record(dataset_dir):
    """A tokenizer's own error for one text (here a RuntimeError) is that record's problem, with file:line."""
    from lightning_mm.data.mm_dataset import load_tokenizer
    from lightning_mm.data.record_files import read_records

    real = load_tokenizer(dataset_dir / "tok")

    class Picky:
        eos_token_id = real.eos_token_id

        def __call__(self, text, **kwargs):
            if "circle" in text:
                raise RuntimeError("no circles here")
            return real(text, **kwargs)

    write_config(dataset_dir, GOOD)
    records, report = read_records("train", (dataset_dir / "train.jsonl",), dataset_dir, Picky(), 16, False)
    assert [r.line for r in records] == [1] and report.total == 2
    assert report.problems == ["train.jsonl:2: the tokenizer rejects the text: RuntimeError: no circles here"]


def test_missing_config_file_and_explicit_overrides(dataset_dir):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        MMDataModule.from_config(dataset_dir / "nope.yaml")
    dm = MMDataModule.from_config(write_config(dataset_dir, GOOD), batch_size=1)
    dm.setup("fit")
    assert dm.batch_size == 1 and len(list(dm.train_dataloader())) == 2


# ------------------------------------------------------------------------------------------ hostile data
def write_raw_lines(root: Path, lines: list[bytes], name: str = "train.jsonl", **extra) -> Path:
    """Like write_config, with record lines given as raw bytes."""
    path = write_config(root, [], **extra)
    (root / name).write_bytes(b"\n".join(lines) + b"\n")
    return path


HOSTILE_LINES = [
    (b'{"image": "img/r.png", "text": "a red \xff square"}', "train.jsonl:3: not UTF-8 text (byte 0xff"),
    (
        b'{"image": "img/r.png", "text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "train.jsonl:3: not valid JSON: nested too deeply",
    ),
    (
        b'{"image": "img/r.png", "text": "a", "n": ' + b"9" * 5000 + b"}",
        "train.jsonl:3: not valid JSON: Exceeds the limit",
    ),
]


@pytest.mark.parametrize(("line", "message"), HOSTILE_LINES)
def test_hostile_record_lines_are_bad_records_with_file_and_line(dataset_dir, line, message):
    good = [json.dumps(g).encode() for g in GOOD]
    dm = MMDataModule.from_config(write_raw_lines(dataset_dir, [*good, line, good[0]]))
    with pytest.warns(UserWarning, match="1 skipped"):
        dm.setup("fit")
    report = dm.reports["train"]
    assert report.total == 4 and report.skipped == 1 and message in report.problems[0], report.problems
    assert len(dm.train_dataloader().dataset) == 3
    strict = MMDataModule.from_config(write_raw_lines(dataset_dir, [*good, line], strict=True))
    with pytest.raises(DataError, match="train.jsonl:3"):
        strict.setup("fit")


def test_a_json_list_file_with_bad_bytes_is_a_bad_record_not_a_crash(dataset_dir):
    (dataset_dir / "list.json").write_bytes(b'[{"image": "img/r.png", "text": "a red \xff"}]')
    dm = MMDataModule.from_config(write_config(dataset_dir, GOOD, val="list.json"))
    with pytest.warns(UserWarning, match="val: 1 records, 0 used, 1 skipped"), pytest.raises(DataError, match="val"):
        dm.setup("fit")
    assert "list.json:1: not UTF-8 text" in dm.reports["val"].problems[0]


def test_an_overlong_line_is_a_bad_record_and_is_not_kept(dataset_dir, monkeypatch):
    from lightning_mm.data import record_files as records

    monkeypatch.setattr(records, "MAX_LINE_BYTES", 64)
    good = [json.dumps(g).encode() for g in GOOD[:1]]
    long_line = json.dumps({"image": "img/r.png", "text": "a " * 200}).encode()
    dm = MMDataModule.from_config(write_raw_lines(dataset_dir, [*good, long_line, *good]))
    with pytest.warns(UserWarning, match="1 skipped"):
        dm.setup("fit")
    assert dm.reports["train"].problems[0].startswith("train.jsonl:2: line longer than")
    assert [r.line for r in dm.train_dataloader().dataset.records] == [1, 3]


@pytest.fixture
def outside(tmp_path_factory):
    """A real picture in a folder next to (not inside) the data root."""
    path = tmp_path_factory.mktemp("outside") / "o.png"
    Image.new("RGB", (20, 12), (0, 255, 0)).save(path)
    return path


def test_image_paths_outside_the_data_root_are_bad_records(dataset_dir, outside):
    (dataset_dir / "img" / "link.png").symlink_to(outside)
    relative = Path("..") / outside.parent.name / outside.name
    escapes = [
        {"image": str(outside), "text": "a red square"},  # absolute
        {"image": "img/link.png", "text": "a red square"},  # symlink leading out
        {"image": f"img/../{relative}", "text": "a red square"},  # '..'
        {"image": "/etc/hostname", "text": "a red square"},
    ]
    dm = MMDataModule.from_config(write_config(dataset_dir, [*GOOD, *escapes]))
    with pytest.warns(UserWarning, match="4 skipped"):
        dm.setup("fit")
    problems = dm.reports["train"].problems
    assert [p.split(": ", 1)[0] for p in problems] == [f"train.jsonl:{i}" for i in (3, 4, 5, 6)]
    assert all("lies outside the data root" in p and "allow_outside_data_root" in p for p in problems)
    assert all(r.image.is_relative_to(dataset_dir.resolve()) for r in dm.train_dataloader().dataset.records)
    # Opting in: the same records are used (the absolute /etc path stays out: it is no image).
    allowed = MMDataModule.from_config(write_config(dataset_dir, [*GOOD, *escapes[:3]], allow_outside_data_root=True))
    allowed.setup("fit")
    assert allowed.reports["train"].skipped == 0 and len(allowed.train_dataloader().dataset) == 5


def test_record_files_outside_the_data_root_are_a_config_error(dataset_dir, outside):
    (outside.parent / "t.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    path = write_config(dataset_dir, GOOD, val=str(outside.parent / "t.jsonl"))
    with pytest.raises(DataConfigError, match="`val`: .*lies outside data_root.*allow_outside_data_root"):
        MMDataModule.from_config(path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"preprocess": []}, "`preprocess` must be a mapping"),
        ({"loader": 0}, "`loader` must be a mapping"),
        ({"loader": False}, "`loader` must be a mapping"),
        ({"allow_outside_data_root": "yes"}, "`allow_outside_data_root`: expected true or false"),
    ],
)
def test_sections_that_are_not_mappings_are_errors(dataset_dir, extra, message):
    path = write_config(dataset_dir, GOOD)
    config = json.loads(path.read_text())
    config.update(extra)
    path.write_text(json.dumps(config))
    with pytest.raises(DataConfigError, match=message):
        MMDataModule.from_config(path)


def test_an_image_that_fails_to_decode_at_load_time_is_replaced_and_counted(dataset_dir):
    from tests.helpers.hostile_files import write_corrupt_png

    write_corrupt_png(dataset_dir / "img" / "corrupt.png")
    lines = [*GOOD, {"image": "img/corrupt.png", "text": "a red circle"}]
    dm = MMDataModule.from_config(write_config(dataset_dir, lines))
    dm.setup("fit")  # verify() passes: nothing is known to be wrong yet
    assert dm.reports["train"].skipped == 0
    with pytest.warns(UserWarning, match=r"train.jsonl:3: cannot decode image"):
        batches = list(dm.train_dataloader())
    assert [len(b["input_ids"]) for b in batches] == [2, 1]  # same number of samples, record 1 in its place
    assert torch.equal(batches[1]["images"][0], batches[0]["images"][0])
    report = dm.reports["train"]
    assert report.skipped == 1 and report.problems[0].startswith("train.jsonl:3: cannot decode image")
    assert "1 skipped" in report.summary()
    list(dm.train_dataloader())  # a second epoch neither decodes it again nor counts it twice
    assert report.skipped == 1

    strict = MMDataModule.from_config(write_config(dataset_dir, lines, strict=True))
    strict.setup("fit")
    with pytest.raises(DataError, match=r"strict mode: train.jsonl:3: cannot decode image .*corrupt.png"):
        list(strict.train_dataloader())


def test_images_that_all_fail_to_decode_end_in_an_error_not_a_scan(dataset_dir, monkeypatch):
    from lightning_mm.data import replacing
    from tests.helpers.hostile_files import write_corrupt_png

    write_corrupt_png(dataset_dir / "img" / "corrupt.png")
    lines = [{"image": "img/corrupt.png", "text": "a red circle"}] * 5
    dm = MMDataModule.from_config(write_config(dataset_dir, lines))
    dm.setup("fit")
    dataset = dm.train_dataloader().dataset
    with pytest.warns(UserWarning), pytest.raises(DataError, match="no record has an image that decodes"):
        dataset[0]
    monkeypatch.setattr(replacing, "MAX_FAILURES_IN_A_ROW", 2)
    dataset.bad.clear()
    with pytest.warns(UserWarning), pytest.raises(DataError, match=r"2 images in a row failed.*train.jsonl:2"):
        dataset[0]
