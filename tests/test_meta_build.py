"""`plan` and `fit` never allocate a parameter of the model they plan (issue #38, item 4).

* Transformers' own meta path (``lightning_mm.hf.meta_build``) gives the same model as building with parameters
  moved to the meta device one by one: the same parameters (meta), the same buffers, value for value, for every
  family the tests train.
* ``lightning-mm plan`` of a Llama config of 1.5 TB (vocab 2,000,000 x hidden 65,536) runs in a process whose
  address space is capped at 4 GiB.
* ``lightning-mm fit`` of that config refuses it in one line naming the size, under the same cap, before anything is
  materialised.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from lightning_mm.core.init_context import meta_parameters
from lightning_mm.hf.derived_adapters import resolve_model_class
from lightning_mm.hf.meta_build import build_on_meta
from tests.helpers.derive_models import ARCHITECTURES, hf_config
from tests.helpers.moe_models import MOE_FAMILIES
from tests.scenarios.hf_scenarios import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
CAP = 4 * 2**30  # bytes of address space for the planning process (the model is 1.5 TB)
HUGE = {
    "model_type": "llama",
    "vocab_size": 2_000_000,
    "hidden_size": 65_536,
    "intermediate_size": 131_072,
    "num_hidden_layers": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}


def _configs() -> dict[str, object]:
    out = {}
    for family, (arch, kwargs) in {**FAMILIES, **MOE_FAMILIES}.items():
        config = getattr(transformers, arch).config_class(**kwargs)
        config.architectures = [arch]
        out[family] = config
    out.update({name: hf_config(name) for name in ARCHITECTURES})
    return out


CONFIGS = _configs()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_meta_path_equals_the_per_parameter_meta_build(name):
    config = CONFIGS[name]
    cls = resolve_model_class(None, config)[1]
    model = build_on_meta(cls, config)
    with meta_parameters():
        reference = cls(config)
    params = [(n, p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters()]
    assert params == [(n, p.shape, p.dtype, p.requires_grad) for n, p in reference.named_parameters()]
    assert all(p.is_meta for p in model.parameters())
    buffers, expected = dict(model.named_buffers()), dict(reference.named_buffers())
    assert buffers.keys() == expected.keys() and buffers
    for key, value in expected.items():
        assert not buffers[key].is_meta and buffers[key].dtype == value.dtype, key
        assert torch.equal(buffers[key], value), key


def _config(tmp_path: Path, trainer: dict) -> Path:
    config = {
        "trainer": {"accelerator": "cpu", "strategy": "mm_fsdp2", "logger": False, **trainer},
        "model": {
            "class_path": "lightning_mm.modules.transformers_module.MMTransformersModule",
            "init_args": {"transformers_model": {"hf_config": HUGE}},
        },
        "data": {
            "class_path": "lightning_mm.MMDataModule",
            "init_args": {"train_valid_test_datasets_provider": "tests.helpers.qwen3_vl_family.datasets_provider"},
        },
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _capped(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``lightning-mm <args>`` run in ``cwd``, in a process whose address space is capped at :data:`CAP`."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_mm.cli", *args],
        cwd=cwd,
        env=env,
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plan_of_a_terabyte_config_runs_in_bounded_memory(tmp_path):
    proc = _capped(tmp_path, "plan", "--config", str(_config(tmp_path, {"devices": 2})), "--world-size", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.embed_tokens" in proc.stdout and "131,072,000,000 params" in proc.stdout
    assert "parameters   24,073.04 MiB" in proc.stdout  # 1.5 TB over 64 ranks


def test_fit_refuses_a_model_the_machine_cannot_hold_in_one_line(tmp_path):
    trainer = {"devices": 1, "max_steps": 1, "enable_checkpointing": False, "enable_progress_bar": False}
    proc = _capped(tmp_path, "fit", "--config", str(_config(tmp_path, trainer)))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the model does not fit: each rank's parameter shards need 1,504.6 GiB (1,615,514,042,368 B)" in errors[0]
    assert "is free there" in errors[0]


_OTHER_SOURCES = """
import torch
from torch import nn
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.diffusers.model import DiffusersModel
from tests.scenarios.wan_scenarios import TINY_WAN


class Custom(nn.Module):  # a model_provider's own module: one 512 GB embedding, a computed buffer
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2_000_000, 65_536)
        self.proj = nn.Linear(65_536, 65_536)
        self.norm = nn.LayerNorm(65_536)
        self.register_buffer("table", torch.arange(4096.0) / 7, persistent=False)


with meta_parameters():
    custom = Custom()
    wan = DiffusersModel(
        {"model_id": "wan", "config": {**TINY_WAN, "num_attention_heads": 64, "attention_head_dim": 128,
                                       "ffn_dim": 131_072, "text_dim": 65_536, "num_layers": 2}}
    )
for model in (custom, wan):
    assert all(p.is_meta for p in model.parameters())
    assert list(model.buffers()) and not any(b.is_meta for b in model.buffers())
assert torch.equal(custom.table, torch.arange(4096.0) / 7)
print("params", sum(p.numel() for p in custom.parameters()) + sum(p.numel() for p in wan.parameters()))
"""


def test_other_model_sources_build_in_bounded_memory_with_their_buffers(tmp_path):
    """Custom modules and DiffusersModel under ``meta_parameters()``: tensors above LARGE_TENSOR_BYTES are created
    on the meta device, so a model of terabytes builds in a 4 GiB address space, buffers computed as before."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_SOURCES],
        cwd=tmp_path,
        env=env,
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) > 1.4 * 10**11  # parameters: more than 0.5 TB in fp32


def test_a_constructor_that_needs_real_values_falls_back_to_meta_parameters():
    """A constructor that reads a value (``.item()``) fails on the meta device; the model is then built as before,
    under ``meta_parameters()``: meta parameters, real buffers."""
    config = CONFIGS["llama_tied"]
    base = resolve_model_class(None, config)[1]

    class ReadsAValue(base):  # type: ignore[misc, valid-type]
        def __init__(self, config):
            super().__init__(config)
            self.rate = torch.linspace(0, 0.1, 3)[1].item()  # a drop-path schedule

    model = build_on_meta(ReadsAValue, config)
    assert model.rate == pytest.approx(0.05) and all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())


def test_the_memory_check_compares_a_ranks_shards_with_the_free_memory_of_their_device(monkeypatch):
    from lightning_mm.core import memory_check
    from lightning_mm.core.config import FSDP2Config
    from lightning_mm.core.memory import per_rank_memory
    from lightning_mm.core.sharding_plan import build_plan

    config = CONFIGS["llama_tied"]
    model = build_on_meta(resolve_model_class(None, config)[1], config)
    plans = {
        offload: build_plan(
            FSDP2Config(sharding_size="auto", offload_to_cpu=offload).with_model_defaults(model), model, 2
        )
        for offload in (False, True)
    }
    need = per_rank_memory(model, plans[False]).params
    seen = []

    def free(device: torch.device) -> int:
        seen.append(device)
        return need - 1

    monkeypatch.setattr(memory_check, "available_bytes", free)
    with pytest.raises(memory_check.ModelTooLargeError, match=rf"need .*\({need:,} B\) on cuda:0 .*\({need - 1:,} B\)"):
        memory_check.check_parameters_fit(model, plans[False], torch.device("cuda", 0))
    with pytest.raises(memory_check.ModelTooLargeError, match=r"on cpu \(sharded over 2 rank"):
        memory_check.check_parameters_fit(model, plans[True], torch.device("cuda", 0))  # offloaded: host memory
    assert seen == [torch.device("cuda", 0), torch.device("cpu")]
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: need)
    memory_check.check_parameters_fit(model, plans[False], torch.device("cuda", 0))  # fits exactly
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 0)
    eager = resolve_model_class(None, config)[1](config)  # real parameters: nothing left to allocate, no check
    memory_check.check_parameters_fit(eager, plans[False], torch.device("cuda", 0))
