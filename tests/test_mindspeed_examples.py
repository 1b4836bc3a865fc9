"""The MindSpeed MM job examples run as their README says: one command each, migrate -> fit -> convert -> generate.

``bash examples/mindspeed_job.sh qwen3vl`` (MindSpeed MM's single-YAML Qwen3-VL launch) and ``... qwen2_5vl`` (its
flag-style Qwen2.5-VL launch with a data.json and a model.json) on 2 CPU processes, with the tiny stand-ins the
script writes. Checked: the migrate report maps the data config and the model config, training finishes its steps,
the converted directory holds the processor files, and ``generate`` from it answers.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "job, model_class",
    [("qwen3vl", "MMQwen3VLForConditionalGeneration"), ("qwen2_5vl", "MMQwen2_5_VLForConditionalGeneration")],
)
def test_a_mindspeed_job_runs_in_one_command(job, model_class):
    env = {**os.environ, "LIGHTNING_MM_SKIP_INSTALL": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        ["bash", "examples/mindspeed_job.sh", job], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    run = ROOT / "runs" / job
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["class_path"].endswith("MMTransformersModule")
    assert Path(config["data"]["init_args"]["data_config"]).is_file()
    assert config["trainer"]["strategy"]["class_path"] == "lightning_mm.MMFSDP2Strategy"
    assert "`Trainer.fit` stopped: `max_steps=40` reached." in out
    assert model_class in out
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "preprocessor_config.json",
    ):
        assert (run / "hf_out" / name).is_file(), name
    answer = [line for line in out.splitlines() if line.startswith("What is in this picture? -> ")]
    assert answer and answer[-1] != "What is in this picture? -> ''", out[-2000:]
