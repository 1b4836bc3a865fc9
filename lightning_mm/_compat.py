"""Every private name of Lightning, torch and Transformers that lightning-mm uses, in one place, behind a version fence.

Where torch 2.13 / Lightning 2.6 / Transformers 5 offer a public API, the package uses it. What is left has none and
is reached only through this module: each name is looked up when this module is imported (or, for attributes of
objects, when it is read) and a missing one raises :class:`PrivateAPIError` naming it and the versions this package
was tested with; nothing falls back to a default that would let a renamed attribute pass silently.
``tests/test_compat.py`` exercises every entry, so a release that moves one fails there first.

Versions outside the tested range (``TESTED``, kept in step with pyproject.toml and constraints.txt) warn once.
The torch names are resolved when this module is imported; the Lightning ones when first imported from here
(module ``__getattr__``), so the FSDP2 core (``lightning_mm.core.apply``) stays free of Lightning; the Transformers
ones when an accessor is first called (Transformers is imported only by the Hugging Face layer).

The package's own modules import each other's public names only (``tests/test_compat.py`` scans for both).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch
from packaging.version import Version

from lightning_mm.errors import LightningMMError

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "TESTED",
    "PrivateAPIError",
    "check_version_fence",
    "is_rng_supported_mesh",
    "all_to_all_single_autograd",
    "shards_along",
    "clear_sharding_prop_cache",
    "reset_torch_layer",
    "local_offsets",
    "fsdp_state",
    "should_update_logs",
    "throughput_meters",
    "set_device_mesh",
    "auto_accelerator",
    "attached_trainer",
    "last_checkpoints",
    "unwrap_optimizer",
    "share_experts_kernels_with_base",
    "DYNAMO_ERRORS",
    "compiled_graph_count",
    "fsspec_storage",
    "INHERITED_PRIVATE_ATTRIBUTES",
    "INHERITED_PRIVATE_METHODS",
    "LIGHTNING_NAMES",
    "attn_implementation",
    "set_attn_implementation",
    "clear_hf_init_flags",
    "HF_INIT_FLAG",
    "TRANSFORMERS_MODEL_ATTRIBUTES",
    "no_split_modules",
    "keys_to_ignore_on_load_unexpected",
    "tied_weights_keys",
]

# [lowest tested, first untested) per distribution.
TESTED = {"torch": ("2.13.0", "2.14.0"), "lightning": ("2.5.0", "2.7.0"), "transformers": ("5.0", "6")}


class PrivateAPIError(LightningMMError, ImportError):
    """A private Lightning, torch or Transformers name that lightning-mm relies on is missing or has changed."""


def _imported_version(name: str) -> str:
    module = sys.modules.get(name)
    return str(module.__version__) if module is not None else "not imported"


def _versions() -> str:
    return (
        f"torch {torch.__version__}, lightning {_imported_version('lightning')}, "
        f"transformers {_imported_version('transformers')}"
    )


def _tested() -> str:
    return ", ".join(f"{name} >={low},<{high}" for name, (low, high) in TESTED.items())


def _missing(what: str) -> PrivateAPIError:
    return PrivateAPIError(
        f"lightning-mm relies on the private {what}, which this installation does not have ({_versions()}; tested "
        f"with {_tested()}). Install the tested versions (pip install -c constraints.txt) or update "
        "lightning_mm/_compat.py."
    )


def check_version_fence(names: tuple[str, ...] = ("torch", "lightning", "transformers")) -> list[str]:
    """The installed distributions among ``names`` outside the tested range (each also warned about)."""
    outside = []
    for name in names:
        version = torch.__version__ if name == "torch" else importlib.import_module(name).__version__
        low, high = TESTED[name]
        if not Version(low) <= Version(Version(version).base_version) < Version(high):
            outside.append(f"{name} {version}")
    if outside:
        warnings.warn(
            f"lightning-mm is tested with {_tested()}, found {', '.join(outside)}: its private-API uses "
            "are checked at import, but behaviour may differ",
            stacklevel=2,
        )
    return outside


def _require(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing(f"`{module}.{name}`") from None


check_version_fence(("torch",))

# ---------------------------------------------------------------------------------------------------- Lightning
LIGHTNING_NAMES = {
    # Lightning's path type alias (``str | Path``), kept so the strategy's signatures match Lightning's.
    "_PATH": "lightning.fabric.utilities.types",
    # The type of Lightning's ``AcceleratorRegistry`` (the ``register_accelerators`` signature names it).
    "_AcceleratorRegistry": "lightning.fabric.accelerators.registry",
    # Lightning's launcher that re-runs the script once per extra local rank (what DDP and FSDP use).
    "_SubprocessScriptLauncher": "lightning.pytorch.strategies.launchers.subprocess_script",
    # The base class of the Trainer's launchers (what ``Trainer.fit`` calls before anything else when set).
    "_Launcher": "lightning.pytorch.strategies.launchers.launcher",
    # Lightning's all-reduce with its "mean"/"sum" semantics, as its own strategies' ``reduce`` use it.
    "_sync_ddp_if_available": "lightning.fabric.utilities.distributed",
    # Lightning's choice for ``accelerator="auto"`` (``auto_accelerator``).
    "_AcceleratorConnector": "lightning.pytorch.trainer.connectors.accelerator_connector",
}
_fenced_lightning = False


def __getattr__(name: str) -> Any:
    global _fenced_lightning
    if name not in LIGHTNING_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _fenced_lightning:
        _fenced_lightning = True
        check_version_fence(("lightning",))
    value = globals()[name] = _require(LIGHTNING_NAMES[name], name)
    return value


#: Attributes of Lightning's strategy base classes that MMFSDP2Strategy reads or that Lightning's connector sets on
#: it (checked by tests/test_compat.py on a real instance).
INHERITED_PRIVATE_ATTRIBUTES = (
    "_forward_redirection",
    "_layer_sync",
    "_launcher",
    "_precision_plugin",
    "_checkpoint_io",
)

#: Methods of Lightning's ``Strategy`` that MMFSDP2Strategy overrides (``_configure_launcher``, which the connector
#: calls to set ``_launcher``) or calls (``_reset_optimizers_and_schedulers``, before re-creating the optimizers after
#: sharding), with their signatures (checked by tests/test_compat.py against Lightning's ``ParallelStrategy``).
INHERITED_PRIVATE_METHODS = {
    "_configure_launcher": "(self) -> None",
    "_reset_optimizers_and_schedulers": "(self) -> None",
}


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's logs (``Trainer(log_every_n_steps)``)."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is None or not hasattr(type(connector), "should_update_logs"):
        raise _missing("`Trainer._logger_connector.should_update_logs`")
    return bool(connector.should_update_logs)


def installs_distributed_sampler(trainer: pl.Trainer) -> bool:
    """Whether Lightning would put a ``DistributedSampler`` into this run's training loader (distributed, and
    ``Trainer(use_distributed_sampler=True)``, the default)."""
    connector = getattr(trainer, "_accelerator_connector", None)
    if (
        connector is None
        or not hasattr(connector, "use_distributed_sampler")
        or not hasattr(connector, "is_distributed")
    ):
        raise _missing("`Trainer._accelerator_connector.use_distributed_sampler` / `.is_distributed`")
    return bool(connector.use_distributed_sampler and connector.is_distributed)


def throughput_meters(monitor: Any) -> dict[Any, Any]:
    """The per-stage ``Throughput`` meters of a Lightning ``ThroughputMonitor`` (made in its ``setup``)."""
    meters = getattr(monitor, "_throughputs", None)
    if not isinstance(meters, dict):
        raise _missing("`ThroughputMonitor._throughputs`")
    return meters


def set_device_mesh(module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """Make ``module.device_mesh`` return ``mesh``, as Lightning's ModelParallelStrategy does."""
    if "_device_mesh" not in vars(module):
        raise _missing("`LightningModule._device_mesh`")
    module._device_mesh = mesh


def last_checkpoints(callback: Any, trainer: pl.Trainer) -> set[str]:
    """The ``last*.ckpt`` entries of a ModelCheckpoint's directory that ``ckpt_path="last"`` chooses among (links
    included, whether their targets exist or not)."""
    find = getattr(callback, "_find_last_checkpoints", None)
    if not callable(find):
        raise _missing("`ModelCheckpoint._find_last_checkpoints`")
    return set(find(trainer))


def auto_accelerator() -> str:
    """The accelerator Lightning picks for ``Trainer(accelerator="auto")``."""
    choose = getattr(__getattr__("_AcceleratorConnector"), "_choose_auto_accelerator", None)
    if not callable(choose):
        raise _missing("`_AcceleratorConnector._choose_auto_accelerator`")
    return str(choose())


# ------------------------------------------------------------------------------------------------------- torch
#: Whether DTensor's random ops keep per-shard offsets on this mesh (CUDA-like devices only).
is_rng_supported_mesh = _require("torch.distributed.tensor._random", "is_rng_supported_mesh")
#: An all-to-all with uneven splits whose backward is the inverse all-to-all (expert-parallel token dispatch).
all_to_all_single_autograd = _require("torch.distributed._functional_collectives", "all_to_all_single_autograd")
#: The placement FSDP2 gives a dimension that tensor parallelism already shards (not a ``Shard`` subclass).
_StridedShard = _require("torch.distributed.tensor.placement_types", "_StridedShard")


def shards_along(placement: Any) -> bool:
    """Whether a DTensor ``placement`` splits the tensor over its mesh dimension: ``Shard``, or the
    ``_StridedShard`` of FSDP2 over tensor parallelism (each rank then holds a different part)."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, (Shard, _StridedShard))


#: Empties DTensor's sharding-propagation caches (Python and C++). They keep the device mesh of every op they have
#: seen, and a mesh keeps its process groups: a destroyed group would stay alive (its gloo connections open).
clear_sharding_prop_cache = _require("torch.distributed.tensor.debug", "_clear_sharding_prop_cache")


def fsspec_storage() -> tuple[type, type]:
    """DCP's fsspec storage classes ``(FsspecWriter, FsspecReader)`` (checkpoints at URLs); their module is private
    and imports fsspec, so it is looked up when first needed."""
    module = "torch.distributed.checkpoint._fsspec_filesystem"
    return _require(module, "FsspecWriter"), _require(module, "FsspecReader")


try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:
    raise _missing("`torch.distributed.fsdp.FSDPModule`") from None
if not callable(getattr(_FSDPModule, "_get_fsdp_state", None)):
    raise _missing("`FSDPModule._get_fsdp_state`")


# torch.compile's capture errors (graph breaks under ``fullgraph=True``, unsupported ops, backend failures) share
# a private base class; ``core.compile`` turns them into an error naming the module.
DYNAMO_ERRORS: tuple[type[BaseException], ...] = (_require("torch._dynamo.exc", "TorchDynamoException"),)
_dynamo_counters = _require("torch._dynamo.utils", "counters")


def compiled_graph_count() -> int:
    """How many graphs torch.compile has compiled in this process (dynamo's ``unique_graphs`` statistic)."""
    return int(_dynamo_counters["stats"]["unique_graphs"])


def fsdp_state(module: Any) -> Any:
    """The FSDP state object of a ``fully_shard``-ed module (modules sharded together share one): how the units of a
    model's own ``_fully_shard``, which the plan does not know, are told apart (``apply.sharded_units``)."""
    return module._get_fsdp_state()


def reset_torch_layer(module: Any) -> None:
    """Run the private ``_reset_parameters()`` by which torch's ``nn.MultiheadAttention`` / ``nn.Transformer``
    initialise their parameters in their constructors."""
    reset = getattr(type(module), "_reset_parameters", None)
    if not callable(reset):
        raise _missing(f"`{type(module).__name__}._reset_parameters`")
    reset(module)


def local_offsets(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of this rank's region of a DTensor in the global tensor (DTensor's chunk list)."""
    chunks = getattr(tensor, "__create_chunk_list__", None)
    if not callable(chunks):
        raise _missing("`DTensor.__create_chunk_list__`")
    found = chunks()
    if len(found) != 1:
        raise NotImplementedError(f"a DTensor with {len(found)} local chunks has no single region")
    return tuple(found[0].offsets), tuple(found[0].sizes)


# --------------------------------------------------------------------------------------------- public helpers
def attached_trainer(module: Any) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or ``None`` (Lightning's public ``trainer`` raises then)."""
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:
        return None


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a LightningOptimizer (public ``LightningOptimizer.optimizer``), or ``optimizer``."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


# ------------------------------------------------------------------------------------------------- Transformers
_fenced_transformers = False


def _fence_transformers() -> Any:
    """Transformers, its version checked against ``TESTED`` once per process."""
    global _fenced_transformers
    import transformers

    if not _fenced_transformers:
        _fenced_transformers = True
        check_version_fence(("transformers",))
    return transformers


def _config_property(config: Any, name: str) -> None:
    _fence_transformers()
    if not hasattr(type(config), name):
        raise _missing(f"`{type(config).__name__}.{name}` (a property of Transformers' PretrainedConfig)")


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a Transformers config selects (``config._attn_implementation``: ``"sdpa"``,
    ``"eager"``, a registered name, or ``None`` before a model chose one)."""
    _config_property(config, "_attn_implementation")
    return config._attn_implementation


def set_attn_implementation(config: Any, name: str) -> None:
    """Select attention implementation ``name`` on a Transformers config and its sub-configs (what
    ``from_pretrained(attn_implementation=...)`` sets; the model's public ``set_attn_implementation`` needs a built
    model and accepts only names Transformers knows at that point)."""
    _config_property(config, "_attn_implementation")
    config._attn_implementation = name


#: Transformers' mark of a module or tensor that its ``initialize_weights`` must skip (set at construction and by
#: ``from_pretrained`` for what it loaded).
HF_INIT_FLAG = "_is_hf_initialized"
_checked_init_flag = False


def clear_hf_init_flags(model: torch.nn.Module) -> None:
    """Forget Transformers' "already initialised" marks on ``model``'s modules, parameters and buffers (set at
    construction, when the tensors were empty), so that ``initialize_weights()`` fills every tensor.

    The mark's name is checked once against Transformers' own ``PreTrainedModel._initialize_weights`` and
    ``transformers.initialization``: a renamed mark would make the clearing a silent no-op, leaving weights empty.
    """
    global _checked_init_flag
    if not _checked_init_flag:
        transformers = _fence_transformers()
        try:
            from transformers import initialization

            sources = inspect.getsource(transformers.PreTrainedModel._initialize_weights) + inspect.getsource(
                initialization.normal_
            )
        except (ImportError, AttributeError, OSError, TypeError):
            sources = ""
        if sources.count(HF_INIT_FLAG) < 2:
            raise _missing(f"initialisation mark `{HF_INIT_FLAG}` of Transformers' `initialize_weights`")
        _checked_init_flag = True
    for module in model.modules():
        module.__dict__.pop(HF_INIT_FLAG, None)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if getattr(tensor, HF_INIT_FLAG, False):
                delattr(tensor, HF_INIT_FLAG)


#: Class attributes by which a Transformers ``PreTrainedModel`` declares its structure to its loaders and to us.
TRANSFORMERS_MODEL_ATTRIBUTES = ("_no_split_modules", "_keys_to_ignore_on_load_unexpected", "_tied_weights_keys")


def _declared(model: Any, name: str) -> Any:
    """``model``'s class declaration ``name``, ``None`` where it declares none (a model that is not a Transformers
    one may declare it too, as diffusers' do); an error if Transformers' ``PreTrainedModel`` no longer has it."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        _fence_transformers()
        if not hasattr(transformers.PreTrainedModel, name):
            raise _missing(f"`PreTrainedModel.{name}`")
    return getattr(model, name, None)


def no_split_modules(model: Any) -> set[str]:
    """The class names of the model's repeated blocks (``_no_split_modules``), empty where it declares none."""
    return set(_declared(model, "_no_split_modules") or ())


def keys_to_ignore_on_load_unexpected(model: Any) -> list[str]:
    """Regular expressions of checkpoint keys the model's class declares ignorable when unexpected."""
    return list(_declared(model, "_keys_to_ignore_on_load_unexpected") or ())


def tied_weights_keys(model: Any) -> Any:
    """The model class's tied-weights declaration (``_tied_weights_keys``: a mapping target -> source in
    Transformers 5), or ``None``."""
    return _declared(model, "_tied_weights_keys")


def share_experts_kernels_with_base(cls: type) -> None:
    """Let a subclass of a Transformers model, defined outside Transformers, use the experts kernels its base uses.

    Transformers 5 decides whether a model class may run its ``grouped_mm``/``batched_mm`` experts by searching the
    source of the module that defines the class for ``@use_experts_implementation`` (``PreTrainedModel.
    _can_set_experts_implementation``) and caches the answer on the class; a subclass defined elsewhere (an adapter)
    would silently run the slower eager loop, or fail when ``experts_implementation`` is asked for. The subclass takes
    its Transformers base's answer instead. A class without a Transformers base is left alone.
    """
    base = next((k for k in cls.__mro__[1:] if k.__module__.startswith("transformers.models.")), None)
    probe = getattr(base, "_can_set_experts_implementation", None)
    if base is None or probe is None:  # not a Transformers model, or a Transformers without experts kernels
        return
    cls._can_set_experts_implementation_cached_value = bool(probe())  # type: ignore[attr-defined]
