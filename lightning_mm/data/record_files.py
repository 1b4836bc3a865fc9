"""Reading and checking multimodal records (JSON / JSON lines) before any training starts.

Each record has an ``image`` path (relative to the data root) and either a ``text`` caption or LLaVA-style
``conversations`` (``[{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]``). Every bad record is
reported with its file and line: a malformed line (invalid JSON or UTF-8, nested too deeply, an integer past
Python's digit limit, a line over :data:`MAX_LINE_BYTES`), a missing key, a missing or unreadable image, an image
path outside the data root (an absolute path, ``..`` or a symlink leading out; allowed only with
``allow_outside_data_root``), an empty text, text that is not valid Unicode (a lone surrogate, e.g. from a JSON
``\\ud800`` escape), more than one ``<image>`` placeholder (a record has one image), a text longer than
``max_length`` when truncation is off, or any other failure to tokenize the record.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from lightning_mm._utils.suggestions import listing
from lightning_mm._utils.yaml_io import short_repr
from lightning_mm.errors import DataError

__all__ = ["Record", "DataReport", "DataError", "read_records", "iter_raw_records", "MAX_LINE_BYTES"]

MAX_LINE_BYTES = 16 << 20
"""Longest JSON line read as one record (16 MiB); a longer line is a bad record, skipped without keeping it."""

IMAGE_PLACEHOLDER = "<image>"
"""The placeholder of a record's image in its text (LLaVA's); one record has one image, so one placeholder at most."""

_USER = ("human", "user")
_ASSISTANT = ("gpt", "assistant")


@dataclass(frozen=True)
class Record:
    """One checked sample: where it came from, its image, and its token ids (prompt ids are not trained on)."""

    file: Path
    line: int
    image: Path
    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


@dataclass
class DataReport:
    """What reading a split found."""

    split: str
    total: int = 0
    truncated: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        return len(self.problems)

    def summary(self, shown: int = 5) -> str:
        text = (
            f"{self.split}: {self.total} records, {self.total - self.skipped} used, {self.skipped} skipped, "
            f"{self.truncated} truncated"
        )
        if self.problems:
            text += "\n  " + listing(self.problems, shown, sep="\n  ")
        return text


def _parse(data: bytes) -> tuple[Any, str | None]:
    """(parsed JSON, None) or (None, why not): every failure of one record's bytes is a bad record, not a crash."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text (byte 0x{data[err.start]:02x} at column {err.start + 1})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, f"not valid JSON: {err.msg}"
    except RecursionError:
        return None, "not valid JSON: nested too deeply"
    except ValueError as err:  # e.g. an integer longer than Python's digit limit
        return None, f"not valid JSON: {str(err)[:120]}"


def iter_raw_records(file: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, parsed record or None, parse error or None) for JSON lines or a JSON list."""
    if file.suffix == ".json":
        data, error = _parse(file.read_bytes())
        if error is not None:
            yield 1, None, error
            return
        if not isinstance(data, list):
            yield 1, None, "a .json data file must hold a list of records"
            return
        for i, item in enumerate(data):
            yield i + 1, item, None
        return
    with open(file, "rb") as handle:
        number = 0
        while True:
            line = handle.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            number += 1
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # drop the rest of the line, a chunk at a time
                    line = handle.readline(MAX_LINE_BYTES)
                yield number, None, f"line longer than {MAX_LINE_BYTES} bytes"
                continue
            if not line.strip():
                continue
            yield number, *_parse(line)


def _all_texts(record: dict) -> list[str]:
    """Every text of a record whose :func:`_texts` succeeded (the caption, or each turn's value)."""
    if "text" in record:
        return [record["text"]]
    return [turn["value"] for turn in record["conversations"]]


def _text_problem(texts: list[str]) -> str | None:
    """Why the texts of one record cannot be used (not Unicode, or placeholders that do not match one image)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate, which no tokenizer takes
            return (
                f"text is not valid Unicode (lone surrogate {short_repr(text[err.start : err.end])} at "
                f"character {err.start + 1})"
            )
    placeholders = sum(text.count(IMAGE_PLACEHOLDER) for text in texts)
    if placeholders > 1:
        return (
            f"{placeholders} `{IMAGE_PLACEHOLDER}` placeholders for one image (a record has one `image`, "
            "so at most one placeholder)"
        )
    return None


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"the tokenizer returned {type(ids).__name__}, not a list of token ids")
    return ids


def _texts(record: dict) -> tuple[str, str]:
    """(prompt, target) of a caption or conversation record; raises ValueError when malformed."""
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise DataError(f"`text` must be a string, got {type(text).__name__}")
        return "", text
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError("`conversations` must be a non-empty list")
        prompt, target = [], []
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise DataError("each conversation turn needs a string `value`")
            role = turn.get("from", turn.get("role"))
            if role in _USER:
                prompt.append(turn["value"].replace("<image>", "").strip())
            elif role in _ASSISTANT:
                target.append(turn["value"])
            else:
                raise DataError(f"unknown conversation role {short_repr(role)} (expected human/user or gpt/assistant)")
        return "\n".join(p for p in prompt if p), "\n".join(target)
    raise DataError("record needs `text` or `conversations`")


def _image_path(root: Path, image: str, allow_outside: bool) -> tuple[Path | None, str | None]:
    """(resolved image path, None) or (None, why not); the path must stay inside ``root`` unless allowed."""
    try:
        path = (root / image).resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte
        return None, f"bad image path {short_repr(image)}: {err}"
    if not allow_outside and not path.is_relative_to(root):
        return None, (
            f"image path {short_repr(image)} lies outside the data root "
            "(set `allow_outside_data_root: true` in the data config to allow it)"
        )
    return path, None


def _check_image(path: Path) -> str | None:
    if not path.is_file():
        return f"image not found: {path}"
    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as err:  # PIL raises many types for broken files
        return f"cannot read image {path}: {err}"
    return None


def read_records(
    split: str,
    files: tuple[Path, ...],
    root: Path,
    tokenizer: Any,
    max_length: int,
    truncation: bool,
    allow_outside: bool = False,
) -> tuple[list[Record], DataReport]:
    """Read and check every record of a split; bad ones go to the report instead of the result.

    Image paths are resolved (symlinks followed) and must lie inside ``root`` unless ``allow_outside``. Any
    exception while one record is checked or tokenized makes that record a bad record (named by file:line), never
    a crash of the run.
    """
    root = root.resolve()
    records: list[Record] = []
    report = DataReport(split)
    check = _RecordCheck(root, tokenizer, max_length, truncation, allow_outside)
    for file in files:
        for line, raw, error in iter_raw_records(file):
            report.total += 1
            where = f"{file.name}:{line}"
            if error is not None:
                report.problems.append(f"{where}: {error}")
                continue
            try:
                result = check(file, line, raw)
            except Exception as err:  # anything else one record can raise (a tokenizer's own errors, ...)
                result = f"cannot preprocess the record: {type(err).__name__}: {str(err)[:200]}"
            if isinstance(result, str):
                report.problems.append(f"{where}: {result}")
                continue
            record, truncated = result
            report.truncated += truncated
            records.append(record)
    return records, report


@dataclass(frozen=True)
class _RecordCheck:
    """One record's checks and tokenization: ``(Record, truncated)``, or why the record is bad."""

    root: Path
    tokenizer: Any
    max_length: int
    truncation: bool
    allow_outside: bool

    def __call__(self, file: Path, line: int, raw: Any) -> tuple[Record, bool] | str:
        if not isinstance(raw, dict):
            return f"a record must be a JSON object, got {type(raw).__name__}"
        image = raw.get("image")
        if not isinstance(image, str) or not image:
            return "missing or non-string `image`"
        try:
            prompt, target = _texts(raw)
        except ValueError as err:
            return str(err)
        if not target.strip():
            return "empty text"
        text_error = _text_problem(_all_texts(raw))
        if text_error is not None:
            return text_error
        path, image_error = _image_path(self.root, image, self.allow_outside)
        if path is not None:
            image_error = _check_image(path)
        if image_error or path is None:
            return str(image_error)
        try:
            prompt_ids = _token_ids(self.tokenizer, prompt) if prompt else []
            target_ids = _token_ids(self.tokenizer, target)
        except Exception as err:  # a tokenizer rejects text in its own ways (TypeError, ValueError, ...)
            return f"the tokenizer rejects the text: {type(err).__name__}: {str(err)[:200]}"
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            target_ids = [*target_ids, eos]
        length = len(prompt_ids) + len(target_ids)
        truncated = False
        if length > self.max_length:
            if not self.truncation:
                return f"text is {length} tokens, longer than max_length {self.max_length} (truncation is off)"
            keep = self.max_length - len(prompt_ids)
            if keep <= 0:
                return f"the prompt alone fills max_length {self.max_length}"
            target_ids, truncated = target_ids[:keep], True
        return Record(file, line, path, tuple(prompt_ids), tuple(target_ids)), truncated
