"""Real files that look valid to a cheap check and fail later, for the data tests and scenarios."""

from __future__ import annotations

import json
import random
import struct
import zlib
from pathlib import Path


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_corrupt_png(path: Path, width: int = 20, height: int = 12) -> Path:
    """An RGB PNG whose chunks and checksums are valid (``Image.verify()`` passes) but whose pixel stream is not:
    every row names filter type 9, which does not exist, so decoding fails."""
    rows = b"".join(b"\x09" + b"\x10" * (3 * width) for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b"")
    )
    return path


def write_captioning_data(root: Path, good: int, corrupt_line: int) -> Path:
    """``good`` real pictures plus the corrupt PNG at line ``corrupt_line`` of train.jsonl, the captioning demo's
    tokenizer and a data.yaml (batch 2, no shuffling); returns the data.yaml path."""
    from examples.captioning.assets import _draw, _tokenizer

    rng = random.Random(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(good):
        _draw((220, 40, 40), "square", rng).save(root / "images" / f"{i}.png")
        lines.append(json.dumps({"image": f"images/{i}.png", "text": "a red square"}))
    write_corrupt_png(root / "images" / "corrupt.png")
    lines.insert(corrupt_line - 1, json.dumps({"image": "images/corrupt.png", "text": "a red circle"}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    _tokenizer(root / "tokenizer")
    config = root / "data.yaml"
    config.write_text(
        "data_root: .\ntrain: train.jsonl\npreprocess: {tokenizer: tokenizer, image_size: 16, "
        "max_length: 8}\nloader: {batch_size: 2, shuffle: false}\n"
    )
    return config
