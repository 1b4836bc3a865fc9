"""Sharegpt records of MindSpeed MM's ``huggingface`` dataset, checked cheaply up front, and their Dataset.

Up front (no pixels): JSON, roles and their order (MindSpeed MM's sharegpt conversion: an optional system turn,
then user and assistant turns alternating, an assistant turn last), ``<image>`` placeholders against the images,
media files present, inside ``dataset_dir`` and readable, text that UTF-8 can encode. Only the text and media paths
are kept; pixels are processed in ``__getitem__``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from lightning_mm._utils.yaml_io import short_repr
from lightning_mm.data.record_files import DataReport, iter_raw_records
from lightning_mm.data.replacing import ReplacingDataset
from lightning_mm.errors import DataError

__all__ = ["ChatRecord", "ChatAttr", "ChatDataset", "read_chat_records"]


@dataclass(frozen=True)
class ChatRecord:
    """One checked record: where it is, its turns (roles ``user``/``assistant``), system prompt and image paths."""

    file: Path
    line: int
    messages: tuple[tuple[str, str], ...]
    system: str | None
    images: tuple[Path, ...]
    videos: tuple[Path, ...] = ()


@dataclass(frozen=True)
class ChatAttr:
    """The column and tag names of ``attr``."""

    messages: str
    role_tag: str
    content_tag: str
    user_tag: str
    assistant_tag: str
    observation_tag: str | None
    function_tag: str | None
    system_tag: str | None
    system: str | None
    images: str | None
    videos: str | None


# ----------------------------------------------------------------------------------------------- records
def _turns(raw: dict, attr: ChatAttr) -> tuple[list[tuple[str, str]], str | None]:
    """MindSpeed MM's sharegpt conversion (``SharegptDatasetConverter``): a leading system turn, then user/assistant
    turns alternating; the turns' and the system turn's texts stripped of surrounding white space."""
    messages = raw.get(attr.messages)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"`{attr.messages}` must be a non-empty list of turns")
    for turn in messages:
        if not isinstance(turn, dict):
            raise DataError(f"each turn of `{attr.messages}` must be an object, got {type(turn).__name__}")
    system = None
    if attr.system:
        system = raw.get(attr.system)
        if system is not None and not isinstance(system, str):
            raise DataError(f"`{attr.system}` must be a string")
    if attr.system_tag and messages[0].get(attr.role_tag) == attr.system_tag:
        system = messages[0].get(attr.content_tag)
        if not isinstance(system, str):
            raise DataError(f"the system turn's `{attr.content_tag}` must be a string")
        system = system.strip()  # as MindSpeed MM's SharegptDatasetConverter
        messages = messages[1:]
    tools = {t for t in (attr.observation_tag, attr.function_tag) if t}
    turns: list[tuple[str, str]] = []
    for i, turn in enumerate(messages):
        role = turn.get(attr.role_tag)
        if role in tools:
            raise DataError(f"turn {i + 1}: role {short_repr(role)} (a tool turn) is not supported here")
        expected = (attr.user_tag, "user") if i % 2 == 0 else (attr.assistant_tag, "assistant")
        if role != expected[0]:
            known = {attr.user_tag, attr.assistant_tag, *tools, attr.system_tag}
            what = "unknown role" if role not in known else "role out of order"
            raise DataError(
                f"turn {i + 1}: {what} {short_repr(role)} (expected {expected[0]!r}: turns alternate "
                f"{attr.user_tag!r} and {attr.assistant_tag!r}, {attr.user_tag!r} first)"
            )
        content = turn.get(attr.content_tag)
        if not isinstance(content, str):
            raise DataError(f"turn {i + 1}: `{attr.content_tag}` must be a string")
        _encodable(content, f"turn {i + 1}")
        turns.append((expected[1], content.strip()))  # MindSpeed MM's SharegptDatasetConverter strips each turn
    if not turns or turns[-1][0] != "assistant":
        raise DataError(f"no {attr.assistant_tag!r} turn ends the conversation")
    if system is not None:
        _encodable(system, "the system prompt")
    return turns, system


def _encodable(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate ("\ud800"): no tokenizer takes it
        raise DataError(f"{what}: not valid Unicode text ({err.reason} at character {err.start})") from None


def _media(raw: dict, column: str | None) -> list[Any]:
    if not column:
        return []
    value = raw.get(column)
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _video_file(name: Any, root: Path, base: Path, allow_outside: bool) -> Path:
    """A video's path, checked as images are (inside ``dataset_dir``, a file); decoded in ``__getitem__``."""
    return _image_file(name, root, base, allow_outside, what="video")


def _image_file(name: Any, root: Path, base: Path, allow_outside: bool, what: str = "image") -> Path:
    if not isinstance(name, str) or not name:
        raise DataError(f"an {what} must be a path, got {short_repr(name)}")
    inside = (root / name).resolve()
    if inside.is_file() and (allow_outside or inside.is_relative_to(root)):
        path = inside
    elif allow_outside:
        path = (base / name).resolve()
    else:
        why = "lies outside" if not inside.is_relative_to(root) else "is not a file in"
        raise DataError(
            f"{what} {short_repr(name)} {why} dataset_dir {root} (set `allow_outside_data_root: true` "
            "next to dataset_param to allow paths outside it)"
        )
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    if what == "video":  # its container and a video stream, read up front; frames are decoded in __getitem__
        from lightning_mm.hf.video_frames import VideoError, probe_video

        try:
            probe_video(path)
        except VideoError as err:
            raise DataError(str(err)) from None
        return path
    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as err:  # PIL raises many types for broken files
        raise DataError(f"cannot read image {path}: {str(err)[:200]}") from None
    return path


def read_chat_records(
    split: str,
    files: tuple[Path, ...],
    attr: ChatAttr,
    root: Path,
    base: Path,
    allow_outside: bool,
    max_samples: int | None,
    video_note: str | None,
) -> tuple[list[ChatRecord], DataReport]:
    """Check every record (the first ``max_samples`` across the files when given); bad ones go to the report.
    ``video_note`` says why records with videos are refused (``None``: videos are built)."""
    from lightning_mm.hf.chat_samples import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

    records: list[ChatRecord] = []
    report = DataReport(split)
    for file in files:
        for line, raw, error in iter_raw_records(file):
            if max_samples is not None and report.total >= max_samples:
                return records, report
            report.total += 1
            where = f"{file.name}:{line}"
            if error is None and not isinstance(raw, dict):
                error = f"a record must be a JSON object, got {type(raw).__name__}"
            if error is None:
                try:
                    turns, system = _turns(raw, attr)
                    videos = _media(raw, attr.videos)
                    text = "".join(c for _, c in turns)
                    if (videos or VIDEO_PLACEHOLDER in text) and video_note is not None:
                        raise DataError(f"videos are not supported here ({video_note})")
                    clips = sum(c.count(VIDEO_PLACEHOLDER) for r, c in turns if r == "user")
                    if any(VIDEO_PLACEHOLDER in c for r, c in turns if r == "assistant"):
                        raise DataError(f"an assistant turn holds {VIDEO_PLACEHOLDER}; videos go in user turns")
                    if clips != len(videos):
                        raise DataError(f"{clips} {VIDEO_PLACEHOLDER} placeholders for {len(videos)} videos")
                    video_paths = tuple(_video_file(name, root, base, allow_outside) for name in videos)
                    images = _media(raw, attr.images)
                    placeholders = sum(c.count(IMAGE_PLACEHOLDER) for r, c in turns if r == "user")
                    if any(IMAGE_PLACEHOLDER in c for r, c in turns if r == "assistant"):
                        raise DataError(f"an assistant turn holds {IMAGE_PLACEHOLDER}; images go in user turns")
                    if placeholders != len(images):
                        raise DataError(f"{placeholders} {IMAGE_PLACEHOLDER} placeholders for {len(images)} images")
                    paths = tuple(_image_file(name, root, base, allow_outside) for name in images)
                except ValueError as err:
                    error = str(err)
            if error is not None:
                report.problems.append(f"{where}: {error}")
                continue
            records.append(ChatRecord(file, line, tuple(turns), system, paths, video_paths))
    return records, report


# ----------------------------------------------------------------------------------------------- dataset
class ChatDataset(ReplacingDataset):
    """Checked records, processed in ``__getitem__`` by a :class:`~lightning_mm.hf.chat_samples.ChatSampleBuilder`.

    A record that fails there (an image that does not decode, text the tokenizer rejects, any exception from the
    processor) is replaced by the next good one, counted with ``file:line`` and warned about, or raises
    :class:`DataError` in strict mode (:mod:`lightning_mm.data.replacing`).
    """

    def __init__(
        self,
        records: list[ChatRecord],
        builder: Callable[..., dict],
        strict: bool = False,
        report: DataReport | None = None,
    ) -> None:
        super().__init__(records, report, strict)
        self.builder = builder

    def sample_lengths(self) -> list[int]:
        """Every sample's token count for token-budget batches: from the text, the images' sizes (read from the
        file headers) and the videos' frame counts and sizes (container metadata) where the image processor allows
        it (:mod:`lightning_mm.hf.chat_lengths`), no image is processed nor frame decoded; else, and for a record
        the builder refuses, by building the sample (a refused record is then reported and its replacement's length
        is used)."""
        from lightning_mm.hf.chat_lengths import chat_sample_length

        lengths = []
        for index, record in enumerate(self.records):
            length = None
            if index not in self.bad:
                try:
                    sizes = []
                    for path in record.images:
                        with Image.open(path) as img:
                            sizes.append(img.size)
                    messages = [{"role": role, "content": content} for role, content in record.messages]
                    length = chat_sample_length(self.builder, messages, record.system, sizes, record.videos)
                except Exception:  # noqa: BLE001 - the record's own problem: building it reports (and replaces) it
                    length = None
            lengths.append(len(self[index]["input_ids"]) if length is None else length)
        return lengths

    def sample(self, record: ChatRecord) -> dict[str, Any]:
        images = []
        for path in record.images:
            with Image.open(path) as img:  # decoded as it is: the builder bounds it, then makes it RGB (MindSpeed MM)
                images.append(img.copy())
        messages = [{"role": role, "content": content} for role, content in record.messages]
        if record.videos:  # decoded and sampled by the builder (it knows video_fps / video_maxlen)
            return self.builder(messages, record.system, images, record.videos)
        return self.builder(messages, record.system, images)
