"""Generates the captioning demo's data on first use: real PNG files, JSONL captions and a local tokenizer.

Images are 32x32 pictures of a coloured shape (circle, square or triangle) on a noisy background; the caption
says which: "a red circle". The tokenizer is a word-level one built with the `tokenizers` library and saved as a
Hugging Face tokenizer directory, so it loads offline with AutoTokenizer.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")
SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]


def _draw(color: tuple[int, int, int], shape: str, rng: random.Random, size: int = 32) -> Image.Image:
    image = Image.new("RGB", (size, size))
    image.putdata([tuple(rng.randint(90, 160) for _ in range(3)) for _ in range(size * size)])
    draw = ImageDraw.Draw(image)
    extent = rng.randint(12, 20)
    x0, y0 = rng.randint(1, size - extent - 1), rng.randint(1, size - extent - 1)
    box = (x0, y0, x0 + extent, y0 + extent)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(x0, y0 + extent), (x0 + extent, y0 + extent), (x0 + extent // 2, y0)], fill=color)
    return image


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, "a", *COLORS, *SHAPES])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )
    fast.save_pretrained(str(directory))


def ensure_assets(root: Path, train: int = 480, val: int = 96, seed: int = 0) -> Path:
    """Create ``root`` (images/, train.jsonl, val.jsonl, tokenizer/) unless it is already complete."""
    root = Path(root)
    if (root / "COMPLETE").exists():
        return root
    tmp = Path(tempfile.mkdtemp(prefix=".assets-", dir=root.parent if root.parent.exists() else None))
    rng = random.Random(seed)
    (tmp / "images").mkdir()
    for split, count in (("train", train), ("val", val)):
        lines = []
        for i in range(count):
            color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
            name = f"images/{split}_{i:04d}.png"
            _draw(COLORS[color], shape, rng).save(tmp / name)
            lines.append(json.dumps({"image": name, "text": f"a {color} {shape}"}))
        (tmp / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    _tokenizer(tmp / "tokenizer")
    (tmp / "COMPLETE").write_text("ok\n")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)  # atomic: a half-written asset folder is never used
    return root
