"""lightning_mm/_compat.py: every private Lightning/torch/Transformers name the package uses resolves on the installed
versions, a missing one fails loudly (never a silent default), no other module reaches for private names itself, and
the package's modules import only each other's public names."""

from __future__ import annotations

import ast
import inspect
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
    from torch.distributed.tensor import Replicate, Shard

    strided = _compat._StridedShard(0, split_factor=2)  # FSDP2's placement over a TP-sharded dimension
    assert not isinstance(strided, Shard) and _compat.shards_along(strided) and _compat.shards_along(Shard(1))
    assert not _compat.shards_along(Replicate())
    assert _compat.clear_sharding_prop_cache() is None  # empties DTensor's caches (process_group.release_ended_groups)
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
    from lightning.pytorch.strategies import ParallelStrategy

    for name, signature in _compat.INHERITED_PRIVATE_METHODS.items():  # what MMFSDP2Strategy overrides or calls
        method = getattr(ParallelStrategy, name, None)
        assert callable(method), name
        assert str(inspect.signature(method, eval_str=True)) == signature, name
        assert str(inspect.signature(getattr(MMFSDP2Strategy, name), eval_str=True)) == signature, name
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

    for name in (*_compat.TRANSFORMERS_MODEL_ATTRIBUTES, "_init_weights", "_initialize_weights"):
        assert hasattr(PreTrainedModel, name), name
    assert hasattr(PretrainedConfig(), "_attn_implementation")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_transformers_accessors_read_and_write_what_transformers_uses():
    from transformers import Qwen2VLConfig

    model = _tiny_llama()
    assert _compat.attn_implementation(model.config) == model.config._attn_implementation
    config = Qwen2VLConfig()
    _compat.set_attn_implementation(config, "eager")  # the composite config and its sub-configs, as Transformers does
    assert _compat.attn_implementation(config) == "eager" == _compat.attn_implementation(config.text_config)
    assert _compat.no_split_modules(model) == {"LlamaDecoderLayer"}
    assert _compat.no_split_modules(torch.nn.Linear(1, 1)) == set()  # a model that is not a Transformers one
    assert _compat.keys_to_ignore_on_load_unexpected(torch.nn.Linear(1, 1)) == []
    assert _compat.tied_weights_keys(model) == model._tied_weights_keys


def test_clearing_transformers_init_marks_makes_initialize_weights_fill_every_tensor():
    model = _tiny_llama()
    layer = model.model.layers[0].mlp.up_proj
    assert getattr(layer, _compat.HF_INIT_FLAG, False)  # marked by the constructor's initialisation
    with torch.no_grad():
        layer.weight.zero_()
    model.initialize_weights()
    assert not layer.weight.any()  # skipped: Transformers honours the mark under this name
    _compat.clear_hf_init_flags(model)
    assert not any(_compat.HF_INIT_FLAG in vars(m) for m in model.modules())
    model.initialize_weights()
    assert layer.weight.any()


def test_a_missing_transformers_name_is_a_loud_error():
    with pytest.raises(_compat.PrivateAPIError, match=r"`object._attn_implementation`.*tested with.*transformers"):
        _compat.attn_implementation(object())
    with pytest.raises(_compat.PrivateAPIError, match="_attn_implementation"):
        _compat.set_attn_implementation(object(), "sdpa")


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
    import transformers

    assert pins["transformers"] == transformers.__version__


_THIRD_PARTY = ("torch", "lightning", "lightning_utilities", "transformers")
_PRIVATE_ACCESS = re.compile(
    r"\._get_fsdp_state\b|(?<!\w)_fsdp_param_groups|_logger_connector|\._trainer\b"
    r"|_AcceleratorConnector|lightning_module\._device_mesh|\bnn\.modules\.\w+\._"
    r"|\._reset_parameters\(|__create_chunk_list__"
    # Transformers (and nn.Module's own dict of parameters)
    r"|\._attn_implementation\b|_is_hf_initialized|\._parameters\[|\btransformers(\.[A-Za-z]\w*)*\._[A-Za-z]"
    # Transformers' (and diffusers') private class declarations, read through the _compat accessors
    r"|\.(_no_split_modules|_tied_weights_keys|_keys_to_ignore_on_load_unexpected)\b"
    r"|[\"'](_attn_implementation|_parameters|_no_split_modules|_tied_weights_keys|_keys_to_ignore_on_load_unexpected)"
    r"[\"']"  # the same through getattr/setattr
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_package_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _third_party_private_imports(tree: ast.AST) -> list[str]:
    """``from torch.x import _y``, ``from transformers._x import y``, ``import lightning.x._y`` (multi-line too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _THIRD_PARTY:
            names = [a.name for a in node.names if _private(a.name)]
            if names or any(_private(part) for part in node.module.split(".")):
                found.append(f"from {node.module} import {', '.join(names or [a.name for a in node.names])}")
        elif isinstance(node, ast.Import):
            found += [
                f"import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in _THIRD_PARTY and any(_private(part) for part in a.name.split("."))
            ]
    return found


def _package_private_imports(tree: ast.AST, where: str) -> list[str]:
    """Private names (functions, classes, constants) of one lightning-mm module used by another: imported
    (``from lightning_mm.x import _y``) or read through an imported module (``store._y``). A private *module*
    (``lightning_mm._utils.yaml_io``) is fine, so is ``import public as _alias``; so are the Lightning names the
    compat fence
    re-exports under their own names (``from lightning_mm._compat import _PATH``)."""
    package = where.rpartition(".")[0]
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{module}" if module else base
            if module.split(".")[0] != "lightning_mm":
                continue
            for alias in node.names:
                if _is_package_module(f"{module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
                elif _private(alias.name) and not (
                    module == "lightning_mm._compat" and alias.name in _compat.LIGHTNING_NAMES
                ):
                    found.append(f"from {module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lightning_mm" and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            module = modules[node.value.id]
            if _private(node.attr) and not _is_package_module(f"{module}.{node.attr}") and module != where:
                found.append(f"{node.value.id}.{node.attr} ({module})")
    return found


def _offenders(path: Path, text: str) -> list[str]:
    """Every reach for a private name of Lightning, torch, Transformers or another lightning-mm module in ``text``."""
    where = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    tree = ast.parse(text)
    found = [m.group(0) for m in _PRIVATE_ACCESS.finditer(text)]
    found += _third_party_private_imports(tree) + _package_private_imports(tree, where)
    return [f"{path.relative_to(ROOT)}: {f}" for f in found]


def test_no_module_outside_compat_reaches_for_private_names():
    offenders = []
    for path in sorted((ROOT / "lightning_mm").rglob("*.py")):
        if path.name != "_compat.py":
            offenders += _offenders(path, path.read_text())
    assert offenders == []


@pytest.mark.parametrize(
    "leak",
    [
        "from torch.distributed.tensor._random import is_rng_supported_mesh",
        "from lightning.fabric.utilities.distributed import (\n    _sync_ddp_if_available,\n)",
        "from transformers.modeling_utils import _init_weights",
        "import transformers.models._x",
        "x = transformers.modeling_utils._get_init_context",
        "config._attn_implementation = 'sdpa'",
        "impl = decoder.config._attn_implementation",
        "module.__dict__.pop('_is_hf_initialized', None)",
        "owner._parameters[leaf] = p",
        "attention = getattr(model.config, '_attn_implementation', None)",
        'setattr(config, "_attn_implementation", "sdpa")',
        "params = getattr(owner, '_parameters')",
        "module._get_fsdp_state()",
        "classes = set(getattr(model, '_no_split_modules', None) or ())",
        "blocks = model._no_split_modules",
        'tied = getattr(model, "_tied_weights_keys", None) or {}',
        "tied = type(model)._tied_weights_keys",
        'ignorable = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()',
        "ignorable = model._keys_to_ignore_on_load_unexpected",
        "from lightning_mm.checkpoint.store import _write_file, open_source",
        "from lightning_mm.hf.mixins import (\n    FSDP2Mixin,\n    _is_hf_model,\n)",
        "from ..checkpoint.store import _write_file",
        "from lightning_mm.checkpoint import store\nstore._write_file(1, 2)",
        "import lightning_mm.checkpoint.store as store\nstore._write_file(1, 2)",
    ],
)
def test_the_scan_finds_each_kind_of_leak(leak):
    assert _offenders(ROOT / "lightning_mm" / "hf" / "example.py", leak + "\n")


@pytest.mark.parametrize(
    "fine",
    [
        "from lightning_mm._utils import safetensors_index as _safetensors",  # a private module
        "from lightning_mm._utils.distributed import local_tensor as _local",  # a public name under a private alias
        "from lightning_mm._compat import _PATH, _SubprocessScriptLauncher",  # the fence's re-exported names
        "from lightning_mm.checkpoint.store import write_file",
        "from lightning_mm.hf.lora import __all__",
        "self._step_norm = None",
        "classes = plan.no_split_modules",  # a public field of the same name
        'tied = getattr(model, "all_tied_weights_keys", None)',  # Transformers' public property
        "raise ValueError('it declares no `_no_split_modules`')",  # named in a message
    ],
)
def test_the_scan_lets_public_names_and_private_modules_pass(fine):
    assert _offenders(ROOT / "lightning_mm" / "hf" / "example.py", fine + "\n") == []


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
