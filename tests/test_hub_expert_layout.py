"""Sliced loading of MoE checkpoints that store one tensor per expert (Qwen3-MoE's Hub layout), in one process.

Transformers 5 fuses ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj.weight`` into ``mlp.experts.gate_up_proj``
and stacks ``down_proj.weight`` into ``mlp.experts.down_proj`` when it loads; sliced loading reads the pieces that
a rank's region covers. The 4-rank expert-parallel side is in ``tests/test_expert_parallel.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.moe_models import tiny_moe_model


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hub_layout") / "qwen3_moe"
    tiny_moe_model("qwen3_moe", seed=3).save_pretrained(path, save_original_format=True)
    keys = json.loads(
        (path / "model.safetensors").read_bytes()[
            8 : 8 + int.from_bytes((path / "model.safetensors").read_bytes()[:8], "little")
        ]
    )
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in keys  # the per-expert layout indeed
    return path


def _reference(path: Path) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_transformers_model_loads_per_expert_layout_as_from_pretrained(hub_dir):
    from lightning_mm.modules import TransformersModel

    model = TransformersModel({"init_from_hf_path": str(hub_dir)})
    ours = {n: p.detach() for n, p in model.named_parameters()}
    ref = _reference(hub_dir)
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("region", [((2, 8, 0), (3, 16, 32)), ((0, 0, 0), (8, 32, 32)), ((5, 20, 4), (1, 12, 8))])
def test_region_of_fused_experts_reads_the_pieces_it_covers(hub_dir, region):
    """Any region of ``gate_up_proj`` (experts, rows across the gate/up boundary, columns) equals that region of
    Transformers' fused tensor."""
    from lightning_mm.hf.loading import _fill_stacked, _open_files
    from lightning_mm.hf.pretrained_index import SafetensorsIndex, build_load_plan

    model = tiny_moe_model("qwen3_moe")
    plan = build_load_plan(model, SafetensorsIndex.from_directory(hub_dir))
    entry = next(e for e in plan.entries if e.names[0] == "model.layers.1.mlp.experts.gate_up_proj")
    assert entry.stacked is not None and len(entry.stacked) == 8 and len(entry.stacked[0]) == 2
    offsets, sizes = region
    out = torch.full(sizes, float("nan"))
    with _open_files(plan) as files:
        _fill_stacked(plan, files, entry.stacked, offsets, sizes, out)
    fused = _reference(hub_dir)["model.layers.1.mlp.experts.gate_up_proj"]
    expected = fused[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    assert torch.equal(out, expected)


def test_missing_expert_piece_is_named(hub_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from lightning_mm.hf.pretrained_index import CheckpointError, SafetensorsIndex, build_load_plan

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((hub_dir / "config.json").read_text())
    tensors = load_file(hub_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(5, 16)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        build_load_plan(tiny_moe_model("qwen3_moe"), SafetensorsIndex.from_directory(broken))
    message = str(err.value)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in message and "missing" in message
    assert "model.layers.0.mlp.experts.down_proj, expert 2" in message
