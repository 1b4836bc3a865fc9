"""lightning_mm/_compat.py: every private Lightning/torch name the package uses resolves on the installed versions,
a missing one fails loudly (never a silent default), and no other module reaches for private names itself."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

from lightning_mm import MMFSDP2Strategy, _compat

ROOT = Path(__file__).resolve().parents[1]


def test_every_lightning_private_name_resolves():
    import lightning.fabric.utilities.distributed as fabric_dist
    from lightning.pytorch.strategies.launchers import subprocess_script

    assert _compat._SubprocessScriptLauncher is subprocess_script._SubprocessScriptLauncher
    assert _compat._sync_ddp_if_available is fabric_dist._sync_ddp_if_available
    for name in _compat.LIGHTNING_NAMES:
        assert getattr(_compat, name) is not None
    assert _compat.auto_accelerator() == "cpu"


def test_a_missing_private_name_is_a_loud_error():
    with pytest.raises(_compat.PrivateAPIError, match=r"private `lightning.fabric.utilities.types._GONE`.*tested with"):
        _compat._require("lightning.fabric.utilities.types", "_GONE")
    with pytest.raises(_compat.PrivateAPIError, match="should_update_logs"):
        _compat.should_update_logs(object())
    with pytest.raises(_compat.PrivateAPIError, match="LightningModule._device_mesh"):
        _compat.set_device_mesh(torch.nn.Linear(1, 1), object())
    with pytest.raises(_compat.PrivateAPIError, match="DTensor.__create_chunk_list__"):
        _compat.local_offsets(torch.zeros(2))
    with pytest.raises(_compat.PrivateAPIError, match="ThroughputMonitor._throughputs"):
        _compat.throughput_meters(object())
    with pytest.raises(AttributeError):
        _compat.not_a_name  # noqa: B018


def test_torch_private_names_behave_as_used():
    from torch.distributed.fsdp import FSDPModule

    assert callable(FSDPModule._get_fsdp_state) and callable(_compat.is_rng_supported_mesh)
    assert callable(_compat.all_to_all_single_autograd)
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    writer, reader = _compat.fsspec_storage()
    assert issubclass(writer, FileSystemWriter) and issubclass(reader, FileSystemReader)
    attention = torch.nn.MultiheadAttention(4, 2)
    torch.nn.init.ones_(attention.in_proj_weight)
    _compat.reset_torch_layer(attention)
    assert not torch.equal(attention.in_proj_weight, torch.ones_like(attention.in_proj_weight))
    with pytest.raises(_compat.PrivateAPIError, match="Linear._reset_parameters"):
        _compat.reset_torch_layer(torch.nn.Linear(1, 1))


def test_lightning_private_attributes_used_on_instances():
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=MMFSDP2Strategy(), sync_batchnorm=True, logger=False, log_every_n_steps=1
    )
    assert isinstance(_compat.should_update_logs(trainer), bool)
    for name in _compat.INHERITED_PRIVATE_ATTRIBUTES:
        assert hasattr(trainer.strategy, name), name
    assert isinstance(trainer.strategy._layer_sync, TorchSyncBatchNorm)  # what Lightning's connector sets
    module = L.LightningModule()
    mesh = object()
    _compat.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh
    assert _compat.attached_trainer(module) is None and _compat.attached_trainer(None) is None
    from lightning.fabric.utilities.throughput import Throughput
    from lightning.pytorch.callbacks import ThroughputMonitor

    assert _compat.throughput_meters(ThroughputMonitor(batch_size_fn=len)) == {}
    assert Throughput().world_size == 1  # the public attribute the context-parallel monitor sets


def test_transformers_model_contract_attributes_exist():
    from transformers import PretrainedConfig, PreTrainedModel

    for name in ("_no_split_modules", "_keys_to_ignore_on_load_unexpected", "_init_weights"):
        assert hasattr(PreTrainedModel, name), name
    assert hasattr(PretrainedConfig(), "_attn_implementation")


def test_installed_versions_are_inside_the_fence_and_agree_with_pyproject_and_constraints():
    assert _compat.check_version_fence() == []
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name, (low, high) in _compat.TESTED.items():  # pyproject's range is the fence's
        assert re.search(
            rf'"{name}>={re.escape(low.removesuffix(".0"))}(\.0)?,<{re.escape(high.removesuffix(".0"))}"', pyproject
        ), name
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert pins["torch"] == torch.__version__.split("+")[0] and pins["lightning"] == L.__version__


_PRIVATE_IMPORT = re.compile(r"^\s*from (torch|lightning|lightning_utilities)(\.\w+)* import .*\b_[A-Za-z]", re.M)
_PRIVATE_ACCESS = re.compile(
    r"\._get_fsdp_state\b|(?<!\w)_fsdp_param_groups|_logger_connector|\._trainer\b"
    r"|_AcceleratorConnector|lightning_module\._device_mesh|\bnn\.modules\.\w+\._"
    r"|\._reset_parameters\(|__create_chunk_list__"
)


def test_no_module_outside_compat_reaches_for_private_names():
    offenders = []
    for path in sorted((ROOT / "lightning_mm").rglob("*.py")):
        if path.name == "_compat.py":
            continue
        text = path.read_text()
        for pattern in (_PRIVATE_IMPORT, _PRIVATE_ACCESS):
            offenders += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in pattern.finditer(text)]
        offenders += [
            f"{path.relative_to(ROOT)}: {m.group(0)}"
            for m in re.finditer(r"from (torch|lightning)(\.\w+)*\._\w+", text)
        ]
    assert offenders == []


def test_moe_adapters_run_the_experts_kernel_of_their_transformers_base():
    """Transformers picks a class's experts kernel by reading the source of the class's module (a private
    heuristic, cached per class): adapters defined here, and a user's own, must still get the base's
    ``grouped_mm``. In a fresh process, before the base class has cached its own answer (subclasses inherit it)."""
    import subprocess
    import sys

    code = """
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_mm.hf.adapters import MMQwen3MoeForCausalLM
from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin

class UsersAdapter(Qwen3MoeForCausalLM, FSDP2Mixin, WeightInitMixin):
    pass

config = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        num_experts=4, num_experts_per_tok=2)
print([cls(config).config._experts_implementation for cls in (MMQwen3MoeForCausalLM, UsersAdapter)])
print(Qwen3MoeForCausalLM(config).config._experts_implementation)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["['grouped_mm', 'grouped_mm']", "grouped_mm"], proc.stdout
