"""Token counts of MindSpeed MM chat samples for token-budget batches, without processing their images
(``lightning_mm.hf.chat_lengths``): each equals the length of the sample the model's own processor builds, on tiny
Qwen2.5-VL, Qwen3-VL and GLM-4.1V directories (one and two images, multi-turn, an image above the pixel bound, a cut);
families whose processor adds text around the image tokens build their samples to count them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mm.datamodules.token_budget import sample_lengths
from lightning_mm.hf.chat_lengths import counts_lengths
from tests import test_families_data as families
from tests.test_hf_data import RECORDS, TEMPLATE, _config, _module, _record
from tests.tiny_vlms import write_tiny_vlm


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {family: write_tiny_vlm(root / family, family) for family in TEMPLATE}


RECORDS_AND_TEXT = [*RECORDS, _record([("user", "Hi there, no image."), ("assistant", "Hello.")])]


def _dataset(models: dict[str, Path], family: str, tmp: Path, monkeypatch: pytest.MonkeyPatch, **basic: Any) -> Any:
    return _module(tmp, monkeypatch, _config(models[family], family, basic=basic), RECORDS_AND_TEXT)._splits["train"]


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("family", list(TEMPLATE))
def test_lengths_equal_the_built_samples_and_process_no_image(
    family: str, cut: bool, models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cut``: ``cutoff_len`` 3 tokens below the longest sample (the multi-turn one, cut in its last answer)."""
    dataset = _dataset(models, family, tmp_path, monkeypatch)
    cutoff = None
    if cut:
        cutoff = max(len(dataset[i]["input_ids"]) for i in range(len(dataset))) - 3
        dataset = _dataset(models, family, tmp_path, monkeypatch, cutoff_len=cutoff)
    _assert_lengths_without_images(dataset, monkeypatch, RECORDS_AND_TEXT)
    if cutoff is not None:
        assert max(len(dataset[i]["input_ids"]) for i in range(len(dataset))) == cutoff


@pytest.mark.parametrize("family", ["glm4v", "gemma3"])
def test_lengths_of_other_families(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-4.1V counts without images (its bounds go to the processor as ``size``); Gemma 3 builds its samples."""
    model = families.write_tiny_family(tmp_path / family, family)
    records = [*families.RECORDS, _record([("user", "Hi there, no image."), ("assistant", "Hello.")])]
    dataset = families._module(tmp_path, monkeypatch, families._config(model, family), records)._splits["train"]
    assert counts_lengths(dataset.builder) == (family == "glm4v")
    if family == "glm4v":
        _assert_lengths_without_images(dataset, monkeypatch, records)
    else:
        assert sample_lengths(dataset) == [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


def _assert_lengths_without_images(dataset: Any, monkeypatch: pytest.MonkeyPatch, records: list[dict]) -> None:
    image_processor = dataset.builder.processor.image_processor
    calls: list[Any] = []
    original = type(image_processor).__call__

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(image_processor), "__call__", counting)
    lengths = sample_lengths(dataset)  # what the token-budget loader plans with
    assert calls == []  # no image was processed
    built = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    assert len(calls) == sum("images" in r for r in records)  # they are when the samples are built
    assert lengths == built
    assert len(set(built)) > 2  # the records differ in length
