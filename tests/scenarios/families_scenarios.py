"""The strategy's side of the data-path parity run (``tests/test_families_data.py``), on 2 ranks.

    python tests/scenarios/families_scenarios.py train OUTDIR     (tests/helpers/scenario_kit.py)

Trains each case of ``CASES`` with the parity harness of ``tests/scenarios/parity_scenarios.py``: ``TransformersModel``
from ``OUTDIR/ckpts/<case family>`` (a tiny ``lightning_mm/testing/tiny_families.py`` directory; no adapter: the derived
default plan), on batches of MindSpeed MM ``dataset_type: huggingface`` samples that the data path builds from
``OUTDIR/data`` with the model's own processor (:class:`DataPathSamples`). The pytest side trains plain
Transformers on the same samples in one process and compares per step. Nothing is mocked.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.parity import Case  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

# case family -> (tiny family, MindSpeed template, padded width): data-path batches of four architectures.
FAMILIES = {
    "data-gemma3": ("gemma3", None, 64),
    "data-glm4v": ("glm4v", "glm4.1v", 64),
    "data-glm4v_moe": ("glm4v_moe", "glm4v_moe", 64),
    "data-qwen2_5_omni_thinker": ("qwen2_5_omni_thinker", "qwen2_omni", 192),
}
_GEMMA3_RECOMPUTE = ["model.vision_tower.encoder.layers.{*}", "model.language_model.layers.{*}"]
CASES = [
    *[Case(f"{name}-plain", name, steps=3) for name in FAMILIES],  # towers trainable
    Case(
        "data-gemma3-recompute-nonreentrant",
        "data-gemma3",
        {"recompute_modules": _GEMMA3_RECOMPUTE, "use_reentrant": False},
        steps=3,
    ),
    Case("data-glm4v-frozen-tower", "data-glm4v", freeze=("model.visual",), steps=3),
]
TOWERS = {
    "data-gemma3": "model.vision_tower",
    "data-glm4v": "model.visual",
    "data-glm4v_moe": "model.visual",
    "data-qwen2_5_omni_thinker": "model.visual",
}
_SAMPLES = 12
_TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")


def prepare(out: Path) -> None:
    """Write the tiny model directories (``OUTDIR/ckpts``) and the records, images and data configs
    (``OUTDIR/data``)."""
    from PIL import Image

    from lightning_mm.testing.tiny_families import write_tiny_family

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    questions = ["<image>What is in this picture?", "<image>Describe the image.", "How many? <image>"]
    answers = ["A red square.", "Two cats.", "The answer is 2.", "No, it is not."]
    records = []
    for i in range(_SAMPLES):
        g = torch.Generator().manual_seed(100 + i)
        pixels = torch.randint(0, 256, (56, 56, 3), generator=g, dtype=torch.uint8)  # one size: fixed-shape batches
        Image.fromarray(pixels.numpy()).save(data / f"{i}.png")
        records.append(
            {
                "messages": [
                    {"role": "user", "content": questions[i % 3]},
                    {"role": "assistant", "content": answers[i % 4]},
                ],
                "images": [f"{i}.png"],
            }
        )
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    for name, (family, template, width) in FAMILIES.items():
        write_tiny_family(out / "ckpts" / name, family, seed=7, init_std=0.1)  # images weigh in the loss
        config = {
            "dataset_type": "huggingface",
            "preprocess_parameters": {
                "model_name_or_path": str(out / "ckpts" / name),
                "image_max_pixels": 56 * 56,
                "image_min_pixels": 1024,
            },
            "basic_parameters": {"template": template, "dataset_dir": str(data), "dataset": str(data / "train.jsonl")},
            "attr": {
                "images": "images",
                "messages": "messages",
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
            },
        }
        (data / f"{name}.json").write_text(json.dumps({"dataset_param": config, "width": width}))


class DataPathSamples(torch.utils.data.Dataset):
    """The data path's samples of one case family, each padded on the right to the family's width (so that the
    harness's ``default_collate`` stacks them; with one image per sample, stacking is the data path's own batching
    of these keys: Qwen-VL-like patches and grids are flattened over the batch by
    ``tests/scenarios/hf_scenarios.py``)."""

    def __init__(self, name: str, out: Path, n: int) -> None:
        from lightning_mm.mindspeed.hf_data import build_huggingface_datasets

        spec = json.loads((out / "data" / f"{name}.json").read_text())
        splits, self.collate, _ = build_huggingface_datasets(
            spec["dataset_param"], {"pad_to_multiple_of": spec["width"]}, out, f"{name}.json", strict=True
        )
        self.samples, self.n, self.width = splits["train"], n, spec["width"]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        batch = self.collate([self.samples[i % len(self.samples)]])
        assert batch["input_ids"].shape[1] == self.width, f"sample {i} is longer than {self.width} tokens"
        return {k: v[0] if k in _TOKEN_KEYS or k != "image_grid_thw" and v.ndim == 4 else v for k, v in batch.items()}


def register(out: Path) -> None:
    """Make the case families known to the parity harness (``tests/helpers/parity.py``'s ``EXTRA``)."""
    import transformers

    from tests.helpers import parity

    for name in FAMILIES:
        arch = transformers.AutoConfig.from_pretrained(out / "ckpts" / name).architectures[0]
        parity.EXTRA[name] = (arch, partial(DataPathSamples, name, out))


@scenario
def train(outdir: Path) -> None:
    from tests.scenarios import parity_scenarios as ps

    register(outdir)
    for case in CASES:

        def run(case: Case = case) -> None:
            record, (trainer, module) = ps._fit(case, outdir / "ckpts", outdir, case.steps)
            plan = trainer.strategy.plan
            record["plan"] = {
                "units": [list(u.modules) for u in plan.units],
                "ignored": list(plan.ignored_modules),
                "recompute": list(plan.recompute_modules),
                "model_class": type(module.model).__name__,
            }
            ps._finish(case, outdir, [record], trainer, module)

        ps._guarded(case, outdir, run)


if __name__ == "__main__":
    scenario_kit.main()
