"""`lightning-mm convert`: dcp-to-hf writes a directory AutoProcessor / AutoTokenizer / generate load, and every
converter refuses bad input in one line (existing or nested outputs, sizes, config.json, a full disk)."""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from lightning_mm.commands import convert_command as convert_cmd
from lightning_mm.hf.checkpoint_records import hf_records
from tests.scenarios.hf_scenarios import IMAGE_TOKEN, VOCAB, tiny_hf_model

_WORDS = ["<pad>", "<s>", "</s>", "<unk>", "<x>", "<image>"] + [f"w{i}" for i in range(6, VOCAB)]


def _processor():
    """A LLaVA processor built locally: a word-level tokenizer (tokenizers), CLIP's PIL image processor, a chat
    template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    assert _WORDS[IMAGE_TOKEN] == "<image>"
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        chat_template=template,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny LLaVA with its processor, saved as a Hugging Face directory, and a checkpoint of it that records
    that directory (as a model loaded with TransformersModel(init_from_hf_path=...) does)."""
    from transformers import LlavaForConditionalGeneration

    root = tmp_path_factory.mktemp("convert")
    hf_dir = root / "pretrained"
    tiny_hf_model("llava", seed=4).save_pretrained(hf_dir)
    _processor().save_pretrained(hf_dir)
    model = LlavaForConditionalGeneration.from_pretrained(hf_dir)
    torch.manual_seed(1)
    with torch.no_grad():  # trained weights differ from the pretrained ones
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    wrapper = torch.nn.Module()
    wrapper.model = model
    (record,) = hf_records(wrapper)
    assert record["pretrained"] == str(hf_dir.resolve())
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "lightning_mm": {"hf": [record]}}, root / "ckpt.pt")
    return root, hf_dir, model.eval()


def _convert(capsys, *args: str) -> tuple[int, list[str]]:
    status = convert_cmd.main(list(args))
    captured = capsys.readouterr()
    return status, captured.err.strip().splitlines()


def test_dcp_to_hf_output_loads_in_autoprocessor_and_generates(pretrained, tmp_path, capsys):
    from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

    root, hf_dir, model = pretrained
    out = tmp_path / "out"
    status, err = _convert(capsys, "dcp-to-hf", str(root / "ckpt.pt"), str(out))
    assert status == 0 and err == [], err
    names = {p.name for p in out.iterdir()}
    assert {
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    } <= names
    assert not {n for n in names if n.endswith((".bin", ".pt"))}
    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "LlavaProcessor"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("w6 w7")["input_ids"][-2:] == [6, 7]
    image = Image.new("RGB", (28, 28), (120, 30, 200))
    prompt = processor.apply_chat_template([{"role": "user", "content": "<image> w6 w7"}], tokenize=False)
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    assert (inputs["input_ids"] == IMAGE_TOKEN).sum() == 4  # (28 / 14)^2 patches
    loaded = LlavaForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        generated = loaded.generate(**inputs, max_new_tokens=4, do_sample=False)
        expected = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 4
    assert torch.equal(generated, expected)  # the checkpoint's weights, not the pretrained ones


def test_dcp_to_hf_takes_the_side_files_from_an_option_or_says_why_not(pretrained, tmp_path, capsys):
    root, hf_dir, _ = pretrained
    record = torch.load(root / "ckpt.pt", weights_only=True)
    record["lightning_mm"]["hf"][0]["pretrained"] = str(tmp_path / "gone")
    config = json.loads(record["lightning_mm"]["hf"][0]["config"])
    config["_name_or_path"] = str(tmp_path / "gone")
    record["lightning_mm"]["hf"][0]["config"] = json.dumps(config)
    torch.save(record, tmp_path / "moved.pt")
    status, err = _convert(capsys, "dcp-to-hf", str(tmp_path / "moved.pt"), str(tmp_path / "plain"))
    assert status == 0 and len(err) == 1 and "no longer exists" in err[0] and "--pretrained-dir" in err[0]
    assert not (tmp_path / "plain" / "tokenizer.json").exists()
    status, err = _convert(
        capsys, "dcp-to-hf", str(tmp_path / "moved.pt"), str(tmp_path / "given"), "--pretrained-dir", str(hf_dir)
    )
    assert status == 0 and err == []
    assert (tmp_path / "given" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()


def _fail(capsys, *args: str) -> str:
    status, err = _convert(capsys, *args)
    assert status == 1 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_no_converter_writes_into_its_source_or_over_an_output(pretrained, tmp_path, capsys):
    from lightning_mm.hf import dcp_conversion as convert

    root, hf_dir, _ = pretrained
    ck = convert.hf_to_dcp(hf_dir, tmp_path / "ck")
    shard = next(ck.glob("*.distcp"))
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    assert "inside the source" in _fail(capsys, "dcp-to-torch", str(ck), str(shard))
    assert "inside the source" in _fail(capsys, "dcp-to-torch", str(ck), str(ck / "new.pt"))
    assert "inside the source" in _fail(capsys, "dcp-to-hf", str(ck), str(ck / "hf"))
    assert "inside the source" in _fail(capsys, "hf-to-dcp", str(hf_dir), str(hf_dir / "ck"))
    assert "contains the source" in _fail(capsys, "dcp-to-torch", str(ck), str(tmp_path))
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep").write_text("mine")
    for args in (
        ["dcp-to-torch", str(ck), str(existing)],
        ["dcp-to-hf", str(root / "ckpt.pt"), str(existing)],
        ["hf-to-dcp", str(hf_dir), str(existing)],
    ):
        assert "output exists" in _fail(capsys, *args)
    assert [p.name for p in existing.iterdir()] == ["keep"]


def test_force_replaces_only_an_earlier_output_of_the_same_converter(pretrained, tmp_path, capsys):
    """``--force`` replaces what the same converter wrote before (whole, once the new output is complete); any
    other existing path is still refused, even with ``--force``, and left as it was."""
    from safetensors.torch import load_file

    root, hf_dir, model = pretrained
    ck, pt, hf = tmp_path / "ck", tmp_path / "ck.pt", tmp_path / "hf"
    for args in (
        ["hf-to-dcp", str(hf_dir), str(ck)],
        ["dcp-to-torch", str(ck), str(pt)],
        ["dcp-to-hf", str(root / "ckpt.pt"), str(hf)],
    ):
        assert _convert(capsys, *args)[0] == 0
        assert "--force" in _fail(capsys, *args)  # an existing output is refused without it
        (Path(args[-1]) / "stale" if Path(args[-1]).is_dir() else tmp_path / "unused").write_text("old")
        assert _convert(capsys, *args, "--force")[0] == 0
        assert not (Path(args[-1]) / "stale").exists()  # replaced, not merged into
    written = load_file(hf / "model.safetensors")
    assert len(written) == len(model.state_dict()) and (hf / "config.json").is_file()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep").write_text("mine")
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for args in (
        ["dcp-to-torch", str(ck), str(other)],
        ["dcp-to-hf", str(root / "ckpt.pt"), str(other)],
        ["hf-to-dcp", str(hf_dir), str(other)],
        ["hf-to-dcp", str(hf_dir), str(file)],
        ["dcp-to-hf", str(root / "ckpt.pt"), str(file)],
    ):
        assert "replaces only an earlier output" in _fail(capsys, *args, "--force")
    assert [p.name for p in other.iterdir()] == ["keep"] and file.read_text() == "mine"


@pytest.mark.parametrize("size", ["inf", "nan", "5XB", "1e400GB", "0", "-1", "", "0.5B"])
def test_max_shard_size_must_be_a_positive_finite_size(pretrained, tmp_path, capsys, size):
    root, _, _ = pretrained
    message = _fail(capsys, "dcp-to-hf", str(root / "ckpt.pt"), str(tmp_path / "out"), "--max-shard-size", size)
    assert message.startswith("lightning-mm convert dcp-to-hf: error: --max-shard-size")
    assert not (tmp_path / "out").exists()


def test_valid_sizes_parse():
    from lightning_mm.hf.dcp_conversion import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1024") == 1024
    assert parse_size("1.5 kb") == 1500 and parse_size("1e3") == 1000


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", ":1: not valid JSON"),
        ("[]", "must hold a JSON object, got list"),
        ('{"model_type": 3}', "`model_type` must be a string"),
        ('{"model_type": "llama", "architectures": "Llama"}', "`architectures` must be a list"),
        ('{"model_type": "llama", "hidden_size": "big", "architectures": ["LlamaForCausalLM"]}', "cannot build"),
    ],
)
def test_malformed_config_json_is_one_line_naming_the_file(pretrained, tmp_path, capsys, content, message):
    root, hf_dir, _ = pretrained
    bad = tmp_path / "config.json"
    bad.write_text(content)
    error = _fail(capsys, "dcp-to-hf", str(root / "ckpt.pt"), str(tmp_path / "out"), "--config", str(bad))
    assert str(bad) in error and message in error, error
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(content)
    (hf / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    if "cannot build" not in message:  # hf-to-dcp reads only the fields it needs
        error = _fail(capsys, "hf-to-dcp", str(hf), str(tmp_path / "ck"))
        assert str(hf / "config.json") in error and message in error, error
    assert not list(tmp_path.glob(".*partial*"))


def test_a_full_disk_is_one_line_and_leaves_no_partial(pretrained, tmp_path, capsys, monkeypatch):
    from lightning_mm.hf import dcp_conversion as convert

    root, _, _ = pretrained

    def full(directory, *args, **kwargs):
        (directory / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert, "_write_shards", full)
    out = tmp_path / "out"
    error = _fail(capsys, "dcp-to-hf", str(root / "ckpt.pt"), str(out))
    assert error == f"lightning-mm convert dcp-to-hf: error: {out}: No space left on device (ENOSPC)"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_full_tmpfs_is_one_line_and_leaves_no_partial(pretrained, tmp_path, capsys):
    root, _, _ = pretrained
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        out = disk / "out"
        error = _fail(capsys, "dcp-to-hf", str(root / "ckpt.pt"), str(out))
        assert error == f"lightning-mm convert dcp-to-hf: error: {out}: No space left on device (ENOSPC)"
        assert list(disk.iterdir()) == []
        error = _fail(capsys, "dcp-to-torch", str(root / "ckpt.pt"), str(disk / "c.pt"))
        assert "No space left on device (ENOSPC)" in error and list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)
