"""Tiny stand-ins for a MindSpeed MM VLM job: a random Hugging Face model directory and a sharegpt-style data set.

MindSpeed MM's examples expect a downloaded checkpoint (``./ckpt/hf_path/<model>``) and a data file in its
``mllm_format_llava_instruct_data.json`` shape. :func:`write_job_inputs` writes both under ``root`` with no network:
the model directory (``config.json``, safetensors weights, tokenizer, image processor and the family's chat template)
comes from :func:`lightning_mm.testing.tiny_vlms.write_tiny_vlm`; the data are PNG pictures of a coloured shape at
several sizes with one- and two-turn conversations about them (``{"messages": [...], "images": [...]}``, the keys of the
data config's ``attr`` section).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

from lightning_mm.testing.tiny_vlms import write_tiny_vlm

__all__ = ["write_job_inputs", "QUESTION"]

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220)}
SHAPES = ("circle", "square")
SIZES = ((32, 32), (48, 32), (32, 64))
QUESTION = "What is in this picture?"


def _picture(color: str, shape: str, size: tuple[int, int], rng: random.Random) -> Image.Image:
    width, height = size
    image = Image.new("RGB", size, (rng.randint(100, 150),) * 3)
    draw = ImageDraw.Draw(image)
    extent = min(width, height) // 2
    x0, y0 = rng.randint(0, width - extent), rng.randint(0, height - extent)
    box = (x0, y0, x0 + extent, y0 + extent)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLORS[color])
    return image


def _records(images: list[tuple[str, str, str]], rng: random.Random) -> list[dict]:
    records = []
    for name, color, shape in images:
        messages = [
            {"role": "user", "content": f"<image>{QUESTION}"},
            {"role": "assistant", "content": f"A {color} {shape}."},
        ]
        if rng.random() < 0.3:  # a second turn, as in LLaVA-Instruct's multi-turn records
            messages += [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "1"}]
        records.append({"messages": messages, "images": [f"images/{name}"]})
    return records


def write_job_inputs(root: str | Path, family: str, model_name: str, count: int = 48, seed: int = 0) -> Path:
    """Write ``root/hf_path/<model_name>`` and ``root/data/`` (images and the JSON records); return ``root``.

    Idempotent: an existing model directory or data file is kept.
    """
    root = Path(root)
    model_dir = root / "hf_path" / model_name
    if not (model_dir / "config.json").is_file():
        write_tiny_vlm(model_dir, family, seed=seed, min_pixels=32 * 32, max_pixels=128 * 128)
    data = root / "data"
    records_file = data / "mllm_format_llava_instruct_data.json"
    if not records_file.is_file():
        rng = random.Random(seed)
        (data / "images").mkdir(parents=True, exist_ok=True)
        made = []
        for i in range(count):
            color, shape, size = rng.choice(list(COLORS)), rng.choice(SHAPES), SIZES[i % len(SIZES)]
            name = f"{i:03d}.png"
            _picture(color, shape, size, rng).save(data / "images" / name)
            made.append((name, color, shape))
        records_file.write_text(json.dumps(_records(made, rng), indent=1))
    return root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="where to write hf_path/ and data/ (e.g. runs/qwen3vl)")
    parser.add_argument("--family", default="qwen3_vl", choices=("qwen3_vl", "qwen2_5_vl"))
    parser.add_argument("--model-name", default="Qwen3-VL-tiny")
    args = parser.parse_args(argv)
    print(f"stand-in written under {write_job_inputs(args.root, args.family, args.model_name)}")


if __name__ == "__main__":
    main()
