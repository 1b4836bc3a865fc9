"""Token counts of MindSpeed MM chat samples for token-budget batches, without processing their images
(``lightning_mm.hf.chat_lengths``): each equals the length of the sample the model's own processor builds, on tiny
Qwen2.5-VL and Qwen3-VL directories (one and two images, multi-turn, an image above the pixel bound, a cut)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mm.datamodules.token_budget import sample_lengths
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
    assert len(calls) == sum(len(r["images"]) > 0 for r in RECORDS_AND_TEXT if "images" in r)  # they are when built
    assert lengths == built
    assert len(set(built)) > 2  # the records differ in length
    if cutoff is not None:
        assert max(built) == cutoff
