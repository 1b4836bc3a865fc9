"""Reading and checking multimodal records (JSON / JSON lines) before any training starts.

Each record has an ``image`` path (relative to the data root) and either a ``text`` caption or LLaVA-style
``conversations`` (``[{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]``). Every bad record is
reported with its file and line: a malformed line (invalid JSON or UTF-8, nested too deeply, an integer past
Python's digit limit, a line over :data:`MAX_LINE_BYTES`), a missing key, a missing or unreadable image, an image
path outside the data root (an absolute path, ``..`` or a symlink leading out; allowed only with
``allow_outside_data_root``), an empty text, or a text longer than ``max_length`` when truncation is off.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from lightning_mm._names import listing
from lightning_mm._yaml import short_repr

__all__ = ["Record", "DataReport", "DataError", "read_records", "MAX_LINE_BYTES"]

MAX_LINE_BYTES = 16 << 20
"""Longest JSON line read as one record (16 MiB); a longer line is a bad record, skipped without keeping it."""

_USER = ("human", "user")
_ASSISTANT = ("gpt", "assistant")


class DataError(ValueError):
    """Bad data in strict mode (or no usable record at all)."""


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
        text = (f"{self.split}: {self.total} records, {self.total - self.skipped} used, {self.skipped} skipped, "
                f"{self.truncated} truncated")
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


def _iter_raw(file: Path) -> Iterator[tuple[int, Any, str | None]]:
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


def _texts(record: dict) -> tuple[str, str]:
    """(prompt, target) of a caption or conversation record; raises ValueError when malformed."""
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f"`text` must be a string, got {type(text).__name__}")
        return "", text
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("`conversations` must be a non-empty list")
        prompt, target = [], []
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise ValueError("each conversation turn needs a string `value`")
            role = turn.get("from", turn.get("role"))
            if role in _USER:
                prompt.append(turn["value"].replace("<image>", "").strip())
            elif role in _ASSISTANT:
                target.append(turn["value"])
            else:
                raise ValueError(
                    f"unknown conversation role {short_repr(role)} (expected human/user or gpt/assistant)"
                )
        return "\n".join(p for p in prompt if p), "\n".join(target)
    raise ValueError("record needs `text` or `conversations`")


def _image_path(root: Path, image: str, allow_outside: bool) -> tuple[Path | None, str | None]:
    """(resolved image path, None) or (None, why not); the path must stay inside ``root`` unless allowed."""
    try:
        path = (root / image).resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte
        return None, f"bad image path {short_repr(image)}: {err}"
    if not allow_outside and not path.is_relative_to(root):
        return None, (f"image path {short_repr(image)} lies outside the data root "
                      "(set `allow_outside_data_root: true` in the data config to allow it)")
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

    Image paths are resolved (symlinks followed) and must lie inside ``root`` unless ``allow_outside``.
    """
    root = root.resolve()
    records: list[Record] = []
    report = DataReport(split)
    eos = tokenizer.eos_token_id
    for file in files:
        for line, raw, error in _iter_raw(file):
            report.total += 1
            where = f"{file.name}:{line}"
            if error is not None:
                report.problems.append(f"{where}: {error}")
                continue
            if not isinstance(raw, dict):
                report.problems.append(f"{where}: a record must be a JSON object, got {type(raw).__name__}")
                continue
            image = raw.get("image")
            if not isinstance(image, str) or not image:
                report.problems.append(f"{where}: missing or non-string `image`")
                continue
            try:
                prompt, target = _texts(raw)
            except ValueError as err:
                report.problems.append(f"{where}: {err}")
                continue
            if not target.strip():
                report.problems.append(f"{where}: empty text")
                continue
            path, image_error = _image_path(root, image, allow_outside)
            if path is not None:
                image_error = _check_image(path)
            if image_error or path is None:
                report.problems.append(f"{where}: {image_error}")
                continue
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
            target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
            if eos is not None:
                target_ids = [*target_ids, eos]
            length = len(prompt_ids) + len(target_ids)
            if length > max_length:
                if not truncation:
                    report.problems.append(
                        f"{where}: text is {length} tokens, longer than max_length {max_length} (truncation is off)"
                    )
                    continue
                report.truncated += 1
                keep = max_length - len(prompt_ids)
                if keep <= 0:
                    report.problems.append(f"{where}: the prompt alone fills max_length {max_length}")
                    continue
                target_ids = target_ids[:keep]
            records.append(Record(file, line, path, tuple(prompt_ids), tuple(target_ids)))
    return records, report
