"""MMFSDP2Strategy: MindSpeed MM's YAML-driven FSDP2 as a Lightning strategy (the lifecycle)."""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

import lightning_mm.hf  # noqa: F401 - registers the `hf` and `lora` checkpoint records (what dcp-to-hf reads)
from lightning_mm import checkpoint
from lightning_mm import checkpoint as ckpt  # where a Lightning parameter is named `checkpoint`
from lightning_mm._compat import (
    _PATH,
    _sync_ddp_if_available,
    attached_trainer,
    set_device_mesh,
)
from lightning_mm.checkpoint import hf_weights
from lightning_mm.core import apply
from lightning_mm.core.backend import process_group_backend
from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.grad_mode import leave_inference_mode, outside_inference_mode
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.core.optimizer import use_fused_steps
from lightning_mm.core.plan import ShardingPlan, build_plan
from lightning_mm.core.precision_policy import resolve_precision_policy
from lightning_mm.hf.checkpoint_format import HF_FORMATS, plan_weights
from lightning_mm.strategies import stopping
from lightning_mm.strategies.async_save import AsyncSaver
from lightning_mm.strategies.cp_setup import ContextParallelSetup
from lightning_mm.strategies.launch import CheckingLauncher, CheckingSubprocessScriptLauncher
from lightning_mm.strategies.precision import MMFSDP2Precision
from lightning_mm.strategies.rendezvous import is_loopback, loopback_store
from lightning_mm.strategies.stopping import SIGNAL_EXIT_STATUS, RunGuard

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MMFSDP2Strategy"]

log = logging.getLogger(__name__)

# The plugins Lightning's connector makes from ``Trainer(precision=...)``: replaced by MMFSDP2Precision of the same
# precision, which refuses the ones it does not support by name (``DoublePrecision``, i.e. "64-true", is refused
# there with the list of supported values, rather than as an unknown plugin).
_STOCK_PRECISION = ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision", "MMFSDP2Precision")


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _drain_gloo_workers() -> None:
    """Barrier on the default gloo group, so that its worker threads release their finished collectives now.

    A gloo worker thread drops its reference to a collective it has run just after the caller's ``wait()`` has
    returned. When that reference is the last one and the work holds a Python object (a collective issued during
    backward keeps the ``contextvars`` context that backward stashes in thread-local state), the release needs the
    GIL; a thread that asks for it once the interpreter is finalizing is ended by ``pthread_exit`` inside a
    ``noexcept`` destructor: ``terminate called without an active exception``, SIGABRT, after a successful run.
    Queuing the barrier takes the workers' queue lock and waiting for it lets go of the GIL, so a pending release
    finishes here, while the interpreter is still whole; the barrier's own work holds no Python object.

    The exit of each rank therefore waits until every rank has finished (up to the process-group timeout for a
    peer that hangs): destroying a gloo group waits for its queued work anyway, so a shorter bound would not help.
    """
    if dist.get_backend() != "gloo":
        return
    try:
        dist.barrier()
    except RuntimeError as err:  # a peer already gone: nothing left to wait for, destroy the group anyway
        log.debug("MMFSDP2Strategy: barrier before destroying the process group at exit failed: %s", err)


def _destroy_process_group_at_exit() -> None:
    """The ``atexit`` handler: let the gloo workers go idle, then destroy the process group."""
    if dist.is_available() and dist.is_initialized():
        _drain_gloo_workers()
    _destroy_process_group()


class MMFSDP2Strategy(ParallelStrategy):
    """Fully sharded data parallel (FSDP2) training driven by a MindSpeed MM ``fsdp2_config.yaml``.

    Args:
        fsdp2_config: a YAML path, a dict, or an :class:`~lightning_mm.FSDP2Config`. ``None`` takes the config
            from the LightningModule's ``fsdp2_config`` attribute, or else shards every parameter at the root
            over all ranks (``sharding_size: auto``).
        process_group_backend: override the backend chosen from the device (gloo, nccl, hccl; mixed with
            ``cpu:gloo`` when offloading).
        timeout: process-group timeout.
        empty_init: build the model of ``configure_model``/``model_provider`` with parameters on the meta device
            (default ``True``); ``False`` builds it eagerly on every rank.
        checkpoint_format: ``"torch_dcp"`` (default): each checkpoint is a directory written in parallel by all
            ranks with torch.distributed.checkpoint; ``"torch"``: one consolidated file written by rank 0. Both
            load on any world size and are written atomically. ``"hf"``: the directory holds the model weights as
            Hugging Face safetensors (``save_pretrained``'s names, ``config.json``: it loads with
            ``from_pretrained``), written sharded by every rank and consolidated (DCP's Hugging Face storage);
            resuming from it is weights-only (fresh optimiser, schedule and loops, with a warning).
            ``"torch_dcp+hf"``: the full ``torch_dcp`` training state plus those safetensors in the same
            directory (resumes exactly from the DCP part). See ``lightning_mm.hf.checkpoint_format``.
        strict_loading: ``None`` (default) follows the LightningModule's ``strict_loading`` (``True`` unless set):
            a checkpoint whose keys differ from the model's fails with the list of keys. ``False`` loads the
            matching keys and warns with the list of skipped ones.
        fused_optimizer_step: ``True`` (default): Adam/AdamW parameter groups that set neither ``fused`` nor
            ``foreach`` use torch's fused step on CPU and CUDA (torch's own CPU default loops over the sharded
            DTensor parameters one by one; see ``lightning_mm.core.optimizer``). The choice is logged.
            ``False`` leaves the implementation to torch.
        stop_timeout: seconds within which a signalled rank (SIGTERM, SIGINT) ends, whatever its main thread is
            doing, and the other ranks stop when one rank process is gone (a SIGTERM, a crash, a kill), see
            ``lightning_mm.strategies.stopping``; a positive finite number. A rank stopped by SIGTERM exits with
            status 143.
        context_parallel_size: ``C`` > 1 turns on Ulysses context parallelism: ``C`` consecutive ranks share
            samples, each holding ``seq / C`` tokens (see ``lightning_mm.core.context_parallel``).
            Parameters stay sharded over all ranks; the sampler runs over ``world / C`` data-parallel ranks.
        context_parallel_algo: ``"ulysses"`` (MindSpeed MM's ``ulysses_cp_algo`` is accepted as the same).
        async_save: ``False`` (default): a save holds the training loop until the checkpoint is written. ``True``:
            a save during ``fit`` stages the state (a copy; pinned memory on an accelerator) and writes it in the
            background while training goes on (``lightning_mm.strategies.async_save``); the checkpoint becomes
            visible, atomically as ever, once complete; a second save, a load, ``on_train_end`` and ``teardown``
            wait for it. Saves outside ``fit`` stay synchronous. MindSpeed MM's ``training.save_async``.
        stop_on_nonfinite: ``True`` (default): a NaN or infinite loss on any rank, or a non-finite global gradient
            norm, stops training on every rank before the optimizer step applies it, with a
            :class:`~lightning_mm.core.finite.NonFiniteError` naming the step and the rank(s) (the loss flags ride
            in the gradient norm's reduction, which ``train/grad_norm`` and clipping reuse). ``False`` trains on
            (e.g. with your own fp16 loss scaling, whose overflowing steps have infinite gradients by design).
        save_ckpt_dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"`` casts the floating weights of the Hugging Face part
            (``checkpoint_format`` ``"hf"``/``"torch_dcp+hf"``; MindSpeed MM's ``save_ckpt_dtype``); ``None``
            keeps the model's dtype. The DCP part is never cast.
        storage_options: for checkpoints at fsspec URLs (``ModelCheckpoint(dirpath="s3://bucket/run")``,
            ``fit(ckpt_path="s3://...")``): the keyword arguments of the fsspec file system (credentials, endpoint,
            e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``), never logged or written
            into a checkpoint. Checkpoints at URLs are ``torch_dcp``, committed by writing their manifest last
            (``lightning_mm.checkpoint.remote``). Lightning's ``ModelCheckpoint`` lists and checks its directory
            through fsspec's own configuration (``FSSPEC_S3_*`` environment variables, ``~/.config/fsspec``).

    ``Trainer(sync_batchnorm=True)`` converts the BatchNorm layers to ``torch.nn.SyncBatchNorm`` before sharding (as
    DDP and FSDP do). ``StochasticWeightAveraging`` is refused at setup: its averaging mixes DTensor and plain
    parameters.

    Module paths in the config are relative to what the LightningModule's ``sharding_target()`` method returns when
    it has one (``MMLightningModule``: its ``model``), else to the LightningModule itself. The whole LightningModule
    is the FSDP root and each step runs through it.
    """

    strategy_name = "mm_fsdp2"

    def __init__(
        self,
        fsdp2_config: FSDP2Config | Mapping[str, Any] | str | Path | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        empty_init: bool = True,
        checkpoint_format: str = "torch_dcp",
        strict_loading: bool | None = None,
        fused_optimizer_step: bool = True,
        stop_timeout: float = 30.0,
        context_parallel_size: int = 1,
        context_parallel_algo: str = "ulysses",
        stop_on_nonfinite: bool = True,
        storage_options: dict[str, Any] | None = None,
        save_ckpt_dtype: str | None = None,
        async_save: bool = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._given_config = FSDP2Config.load(fsdp2_config) if fsdp2_config is not None else None
        self._config: FSDP2Config | None = self._given_config
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._empty_init = empty_init
        self.num_nodes = 1
        self._device_mesh: DeviceMesh | None = None
        self._plan: ShardingPlan | None = None
        self._sharded: apply.ShardedModel | None = None
        self._gradient_sync = True
        if checkpoint_format not in (*checkpoint.FORMATS, *HF_FORMATS):
            raise ValueError(
                f"checkpoint_format must be one of {(*checkpoint.FORMATS, *HF_FORMATS)}, got {checkpoint_format!r}"
            )
        self.checkpoint_format = checkpoint_format
        self._save_dtype = hf_weights.check_dtype(save_ckpt_dtype)
        if save_ckpt_dtype is not None and checkpoint_format not in HF_FORMATS:
            raise ValueError(
                f"save_ckpt_dtype={save_ckpt_dtype!r} casts the Hugging Face weights of a checkpoint: "
                f"it needs checkpoint_format 'hf' or 'torch_dcp+hf', not {checkpoint_format!r}"
            )
        self.save_ckpt_dtype = save_ckpt_dtype
        self._strict_loading = strict_loading
        self._fused_optimizer_step = fused_optimizer_step
        self._pending_rng: dict[str, Any] | None = None
        self._pending_rng_point: str | None = None
        self._pending_rng_step: int | None = None
        # Expert parallelism: how checkpoints see the local experts.
        self._expert_layout: Any = None  # built on the first checkpoint save or load
        self.stop_timeout = stopping.check_stop_timeout(stop_timeout)
        self._guard: RunGuard | None = None
        self._context_parallel = ContextParallelSetup(context_parallel_size, context_parallel_algo)
        if not isinstance(stop_on_nonfinite, bool):
            raise TypeError(f"stop_on_nonfinite must be True or False, got {stop_on_nonfinite!r}")
        self.stop_on_nonfinite = stop_on_nonfinite
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self._storage_options = dict(storage_options) if storage_options is not None else None
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}")
        if async_save and checkpoint_format in HF_FORMATS:
            raise ValueError(
                f"async_save=True cannot write checkpoint_format={checkpoint_format!r} in the background "
                "(its Hugging Face weights are read from the live model); use 'torch_dcp' or 'torch'"
            )
        self.async_save = async_save
        self._async_saver = AsyncSaver()
        self._warned_async_url = False

    # ------------------------------------------------------------------------------------ properties
    @property
    def fsdp2_config(self) -> FSDP2Config:
        """The config in force (known once the LightningModule is attached)."""
        if self._config is None:
            self._config = self._config_from_module()
        elif self._config is self._given_config:
            self._check_single_config()
        return self._config

    def _check_single_config(self) -> None:
        """A config on both the strategy and the LightningModule must agree: neither is silently dropped."""
        module_config = getattr(self.lightning_module, "fsdp2_config", None)
        if module_config is not None and FSDP2Config.load(module_config) != self._given_config:
            raise ValueError(
                "MMFSDP2Strategy was given an fsdp2_config and the LightningModule has a different one "
                f"({type(self.lightning_module).__name__}.fsdp2_config); give it in one place"
            )

    @property
    def plan(self) -> ShardingPlan:
        """The sharding plan applied at setup."""
        if self._plan is None:
            raise RuntimeError("The sharding plan is built in `setup()`; it is not available yet.")
        return self._plan

    @property
    def context_parallel_group(self) -> Any:
        """The context-parallel process group of this rank (``None`` when ``context_parallel_size`` is 1)."""
        return self._context_parallel.group

    @property
    def context_parallel_size(self) -> int:
        return self._context_parallel.size

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the processes are initialised (`setup_environment`).")
        return self._device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to sync logged values and to use distributed samplers."""
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._context_parallel.enabled:  # the ranks of a context-parallel group read the same samples
            return self._context_parallel.sampler_kwargs(self.global_rank)
        # FSDP and HSDP are both data parallel over every rank: the data-parallel rank is the flat mesh index.
        mesh = self.device_mesh
        if mesh.ndim == 1:
            return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}
        rank = mesh.get_local_rank("replicate") * mesh["shard"].size() + mesh.get_local_rank("shard")
        return {"num_replicas": mesh.size(), "rank": rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else MMFSDP2Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, MMFSDP2Precision):
            if type(plugin).__name__ not in _STOCK_PRECISION:
                raise TypeError(
                    f"MMFSDP2Strategy handles precision itself and cannot use {type(plugin).__name__}; pass "
                    "Trainer(precision=...) or MMFSDP2Precision"
                )
            plugin = MMFSDP2Precision(str(plugin.precision))
        self._precision_plugin = plugin

    # ------------------------------------------------------------------------------------- launching
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._given_config is not None:
            self._given_config.resolve_sharding_size(self.num_nodes * self.num_processes)  # fail before launching
        # Both check ckpt_path="last" first (lightning_mm.strategies.launch).
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = CheckingSubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = CheckingLauncher()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        self._check_callbacks()
        self._start_guard()
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        config = self.fsdp2_config
        if self._process_group_backend is None:
            self._process_group_backend = process_group_backend(self.root_device, config.offload_to_cpu)
        self._init_process_group()
        sharding = config.resolve_sharding_size(self.world_size)
        self._device_mesh = apply.build_device_mesh(self.world_size, sharding, self.root_device.type)
        assert self.lightning_module is not None
        set_device_mesh(self.lightning_module, self._device_mesh)
        self._context_parallel.setup(self.world_size, self.root_device.type)

    def _check_callbacks(self) -> None:
        """Refuse, before any process group or epoch, the callbacks that cannot work on sharded parameters."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        swa = [type(c).__name__ for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]
        if swa:
            raise MisconfigurationException(
                f"MMFSDP2Strategy does not support the {swa[0]} callback: it averages a copy of the unsharded "
                "module into the sharded (DTensor) parameters, which fails once `swa_epoch_start` is reached. "
                "Remove the callback, or average the weights yourself, e.g. with torch.optim.swa_utils.AveragedModel "
                "over the sharded module after `fully_shard`."
            )

    def _start_guard(self) -> None:
        """Watch the other rank processes for this run (see ``lightning_mm.strategies.stopping``)."""
        if self._guard is not None:
            self._guard.stop()
        env = self.cluster_environment
        stopping.remember_children(list(getattr(self._launcher, "procs", None) or []))
        # A rank that Lightning's launcher started (a LightningEnvironment rank > 0) watches its launcher.
        launched = type(env) is LightningEnvironment and env.creates_processes_externally and env.local_rank() > 0
        self._guard = RunGuard(self.stop_timeout, children=stopping.launched_children, watch_parent=launched)
        self._guard.start()

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            return
        env = self.cluster_environment
        assert env is not None
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if type(env) is LightningEnvironment and self.num_nodes == 1 and is_loopback(env.main_address):
            # A single-node run started by Lightning: the rendezvous store listens on the loopback interface only.
            # (torchrun's agent owns the store of the runs it starts.)
            kwargs["store"] = loopback_store(
                env.main_address, env.main_port, self.global_rank, self.world_size, self._timeout
            )
        dist.init_process_group(
            self._process_group_backend, rank=self.global_rank, world_size=self.world_size, **kwargs
        )
        # Ours to destroy: after a failed run (teardown) and at interpreter exit. Not after a successful run: the
        # sharded model keeps using this group if the same Trainer goes on to validate, test or predict.
        self._created_process_group = True
        atexit.unregister(_destroy_process_group_at_exit)
        atexit.register(_destroy_process_group_at_exit)
        rank_zero_info(f"MMFSDP2Strategy: {self.world_size} processes, backend {self._process_group_backend}")

    def _config_from_module(self) -> FSDP2Config:
        module_config = getattr(self.lightning_module, "fsdp2_config", None)
        if module_config is not None:
            return FSDP2Config.load(module_config)
        return FSDP2Config(sharding_size="auto")

    # ------------------------------------------------------------------------------- model building
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Parameters created here go to the meta device (buffers stay real) unless ``empty_init=False``.

        Inside a caller's ``torch.inference_mode`` the model is still built with ordinary tensors (under
        ``no_grad``): FSDP2 cannot shard inference tensors.
        """
        meta = self._empty_init if empty_init is None else empty_init
        with leave_inference_mode(), self.precision_plugin.tensor_init_context():
            if meta:
                with meta_parameters():
                    yield
            else:
                yield

    def _sharding_target(self) -> nn.Module:
        """The module the config's paths are relative to: the LightningModule's ``sharding_target()`` (for
        ``MMLightningModule``, its ``model``) when it has one, else the LightningModule itself."""
        lm = self.lightning_module
        assert lm is not None
        sharding_target = getattr(lm, "sharding_target", None)
        return sharding_target() if callable(sharding_target) else lm

    @override
    @outside_inference_mode
    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model (and set up optimisers when fitting); outside a caller's ``torch.inference_mode``."""
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        root = self.lightning_module
        assert root is not None
        if trainer.state.fn == TrainerFn.PREDICTING:
            self._context_parallel.refuse_prediction(root)
        if not isinstance(root, FSDPModule):
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
                self._apply_layer_sync(root)
            self._shard(root)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            if self._fused_optimizer_step:
                self._use_fused_optimizer_steps()
        if isinstance(self.precision_plugin, MMFSDP2Precision):
            self.precision_plugin.stop_on_nonfinite = self.stop_on_nonfinite
        self.setup_precision_plugin()

    def _apply_layer_sync(self, root: pl.LightningModule) -> None:
        """``Trainer(sync_batchnorm=True)``: convert the BatchNorm layers before sharding, as DDP and FSDP do."""
        assert self._layer_sync is not None
        converted = self._layer_sync.apply(root)
        if converted is not root:
            raise TypeError(
                f"{type(self._layer_sync).__name__} replaced the LightningModule itself; MMFSDP2Strategy "
                "can only convert layers inside it"
            )
        count = sum(isinstance(m, nn.SyncBatchNorm) for m in root.modules())
        rank_zero_info(f"Trainer(sync_batchnorm=True): {count} SyncBatchNorm layer(s), synchronised over all ranks")
        if count and self.root_device.type == "cpu":
            rank_zero_warn(
                f"Trainer(sync_batchnorm=True) on CPU: torch's SyncBatchNorm synchronises only on GPU/NPU-class "
                f"devices, so a training forward through the {count} converted layer(s) will fail on CPU "
                "(evaluation, which uses the running statistics, works)."
            )

    def _use_fused_optimizer_steps(self) -> None:
        decisions = use_fused_steps(self.optimizers)
        fused = [d for d in decisions if d.fused]
        kept = [d for d in decisions if not d.fused]
        if fused:
            rank_zero_info(
                f"Optimizer step: torch's fused Adam/AdamW for {len(fused)} parameter group(s) that left "
                "`fused`/`foreach` unset (MMFSDP2Strategy(fused_optimizer_step=False) keeps torch's choice)"
            )
        for d in kept:
            rank_zero_info(f"Optimizer step: {d.describe()}")

    def _shard(self, root: pl.LightningModule) -> None:
        """Resolve the config and the precision, build the plan and log it, apply it (``apply.apply_plan``)."""
        target = self._sharding_target()
        config = self._config = self.fsdp2_config.with_model_defaults(target)
        precision = resolve_precision_policy(config, str(self.precision_plugin.precision))
        root_converted = self.precision_plugin.convert_module(root)
        assert root_converted is root
        self._plan = plan = build_plan(config, target, self.world_size, precision)
        rank_zero_info(plan.describe())
        self._context_parallel.apply(root, target)
        self._sharded = apply.apply_plan(
            root, target, plan, self.device_mesh, self.root_device, apply.model_unit_sharding(target, config)
        )
        if isinstance(self.precision_plugin, MMFSDP2Precision):  # gradient norms: local experts summed over EP
            self.precision_plugin.norm_groups = self._sharded.norm_groups

    # ---------------------------------------------------------------------------------------- steps
    def _through_root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a LightningModule step as the FSDP root's forward, so FSDP's root hooks run around it."""
        assert self.lightning_module is not None
        return self._forward_redirection(self.lightning_module, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_root("training_step", *args, **kwargs)

    # Evaluation steps leave a caller's inference mode (FSDP2 cannot gather into inference tensors) for no_grad, as
    # Lightning's loops choose no_grad for its FSDP strategy.
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with leave_inference_mode(), self.precision_plugin.val_step_context():
            return self._through_root("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with leave_inference_mode(), self.precision_plugin.test_step_context():
            return self._through_root("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with leave_inference_mode(), self.precision_plugin.predict_step_context():
            return self._through_root("predict_step", *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no reduce-scatter (and no ignored-gradient all-reduce) until the last micro-batch."""
        root = self.lightning_module
        if not isinstance(root, FSDPModule):
            yield
            return
        root.set_requires_gradient_sync(False)
        self._gradient_sync = False
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            self._gradient_sync = True

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._gradient_sync and self._sharded is not None:  # FSDP reduces the rest in its own backward hooks
            self._sharded.reduce_unsharded_gradients()

    @override
    def model_to_device(self) -> None:
        pass  # placement is part of sharding and materialisation

    # ----------------------------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if self.is_global_zero:  # ModelCheckpoint links `last` and then calls this: never to a pending checkpoint
            self._async_saver.hide_links()
        if not dist.is_initialized():
            return
        if self.root_device.type != "cpu":  # nccl, hccl, xccl...: the barrier runs on this rank's own device
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def on_train_start(self) -> None:
        self._install_signal_handler()

    @override
    def on_train_end(self) -> None:
        self.wait_for_checkpoint()  # fit returns with every checkpoint it saved in place

    @override
    def on_validation_start(self) -> None:
        self._install_signal_handler()

    @override
    def on_test_start(self) -> None:
        self._install_signal_handler()

    @override
    def on_predict_start(self) -> None:
        self._install_signal_handler()

    def _install_signal_handler(self) -> None:
        """After Lightning's own: SIGTERM ends this rank without a collective (``lightning_mm.strategies.stopping``)."""
        if self._guard is not None:
            self._guard.install_signal_handler()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._run_failed = True
        if self._guard is not None:  # this rank is failing on its own: its error, not a peer's loss, is reported
            self._guard.failed()
        if isinstance(exception, SIGTERMException) and not exception.code:
            exception.code = SIGNAL_EXIT_STATUS  # a run stopped by a signal must not exit with status 0

    @override
    def teardown(self) -> None:
        """Release the accelerator; after a failed run, also destroy the process group this strategy created.

        A failed run frees its communicators here (peers blocked in a collective then fail instead of waiting for
        the timeout, and a later Trainer in this process starts a fresh group). After a successful run the group
        stays, because the sharded model is bound to it; it is destroyed at interpreter exit.
        """
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        if getattr(self, "_run_failed", False):
            self._async_saver.settle(self.stop_timeout)  # completes it if it can, else its partial stays hidden
        else:
            self.wait_for_checkpoint()
        if getattr(self, "_run_failed", False) and getattr(self, "_created_process_group", False):
            _destroy_process_group()
            self._created_process_group = False
        self._run_failed = False
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ----------------------------------------------------------------------------------- checkpoints
    # See lightning_mm/checkpoint/: torch_dcp directories or consolidated torch files, written atomically,
    # loaded strictly (keys listed) and safely (weights_only), resharded to any world size.
    # Every entry point leaves inference mode: DTensor state dicts cannot be taken or loaded under it.
    @override
    @checkpoint.outside_inference_mode
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards (``torch_dcp``), or the gathered state on rank 0 (``torch``)."""
        assert self.lightning_module is not None
        full = self.checkpoint_format == "torch"
        return checkpoint.model_state(self.lightning_module, full=full, view=self._expert_view("model"))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint, which checks the keys

    @override
    @checkpoint.outside_inference_mode
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's shards keyed by parameter name (``torch_dcp``), or the gathered state on rank 0 in torch's
        layout, keyed by parameter index with the names alongside (``torch``)."""
        assert self.lightning_module is not None
        full = self.checkpoint_format == "torch"
        return checkpoint.optimizer_state(
            self.lightning_module, optimizer, full=full, view=self._expert_view("optimizer")
        )

    def _expert_view(self, kind: str) -> Any:
        """With expert parallelism, how checkpoints see the local experts: as their share of the global
        (all-experts) tensors, in both formats and both directions (any ``expert_parallel_size`` reads any)."""
        plan = self._plan
        if plan is None or plan.experts is None:
            return None
        from lightning_mm.core import expert_parallel

        if self._expert_layout is None:
            assert self._sharded is not None and self._sharded.ep_mesh is not None
            names = expert_parallel.expert_state_names(self.lightning_module, plan, self._sharding_target())
            self._expert_layout = expert_parallel.ExpertCheckpointLayout(
                self._sharded.ep_mesh, plan.experts.num_experts, names
            )
        layout = self._expert_layout
        return layout.model_state if kind == "model" else layout.optimizer_state

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in place by load_checkpoint

    def _check_checkpoint_io(self) -> None:
        from lightning.fabric.plugins import TorchCheckpointIO

        if self._checkpoint_io is not None and type(self._checkpoint_io) is not TorchCheckpointIO:
            raise TypeError(
                f"MMFSDP2Strategy writes its checkpoints itself (checkpoint_format="
                f"{self.checkpoint_format!r}); the {type(self._checkpoint_io).__name__} plugin cannot be "
                "used with it"
            )

    def _rng_point(self) -> str:
        """Where a resumed run restores the RNG: before the next batch, or before the next epoch's data iterator."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is None:
            return "next_batch"
        return "next_epoch" if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch else "next_batch"

    @override
    @checkpoint.outside_inference_mode
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write a checkpoint with every rank (``torch_dcp``) or from rank 0 (``torch``); visible once complete."""
        target = self.broadcast(str(filepath))
        if storage_options is not None and not ckpt.remote.is_url(target):
            raise TypeError(
                "MMFSDP2Strategy writes its checkpoints itself; `storage_options` is only used for "
                "checkpoints at URLs (s3://...)"
            )
        self._check_checkpoint_io()
        self.wait_for_checkpoint()  # a second save waits for the first
        lm = self.lightning_module
        assert lm is not None
        path = target if ckpt.remote.is_url(target) else Path(target)
        extra = {
            "format_version": ckpt.FORMAT_VERSION,
            "kind": ckpt.KIND_TRAINING,
            "world_size": self.world_size,
            "mesh_shape": list(self.device_mesh.shape),
            "rng_point": self._rng_point(),
            **ckpt.collect_records(lm),  # what other layers record (registered record providers)
        }
        if self.checkpoint_format == "torch" and "optimizer_states" in checkpoint:  # what the indices stand for
            extra[ckpt.OPTIMIZER_NAMES_KEY] = ckpt.optimizer_param_names(lm, self.optimizers)
        if self.checkpoint_format in HF_FORMATS:
            self._save_with_hf_weights(checkpoint, path, extra)
            return
        if isinstance(path, str):  # a URL
            if self.async_save and not self._warned_async_url:
                self._warned_async_url = True
                rank_zero_warn(f"async_save: {path} is at a URL; checkpoints at URLs are written synchronously")
            options = storage_options if storage_options is not None else self._storage_options
            ckpt.remote.save(
                checkpoint, path, self.checkpoint_format, extra, ckpt.capture_rng(self.root_device), options
            )
            return
        trainer = attached_trainer(lm)
        fitting = (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )
        if not (self.async_save and fitting):
            ckpt.save(checkpoint, path, self.checkpoint_format, extra, ckpt.capture_rng(self.root_device))
            return
        self._async_saver.start(
            path,
            self.is_global_zero,
            lambda executor, group: ckpt.save(
                checkpoint,
                path,
                self.checkpoint_format,
                extra,
                ckpt.capture_rng(self.root_device),
                background=executor,
                group=group,
            ),
            self._timeout,
        )

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background (``async_save=True``) is in place; raise what
        its write raised. Nothing to do without one."""
        self._async_saver.wait()

    def _save_with_hf_weights(self, checkpoint: dict[str, Any], path: Path | str, extra: dict[str, Any]) -> None:
        """``checkpoint_format`` ``"hf"`` (the weights only, as safetensors) or ``"torch_dcp+hf"`` (both)."""
        if isinstance(path, str):
            raise ValueError(
                f"{path}: checkpoint_format={self.checkpoint_format!r} cannot be written to a URL; "
                "checkpoints at URLs are 'torch_dcp' directories"
            )
        state = checkpoint.get("state_dict") or {}
        weights = plan_weights(self.lightning_module, list(state))
        extra[hf_weights.RECORD_KEY] = weights.record(self.save_ckpt_dtype)
        if self.checkpoint_format == "hf":
            checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            extra["kind"] = ckpt.KIND_WEIGHTS
        ckpt.save(
            checkpoint,
            path,
            "torch_dcp",
            extra,
            ckpt.capture_rng(self.root_device),
            also_write=weights.writer(state, self._save_dtype),
        )

    @override
    @checkpoint.outside_inference_mode
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and (when fitting) optimiser state in place, with strict key checks; return the rest.

        Per-rank state (RNG, dataloader position) is restored when the world size is unchanged: the dataloader
        position through Lightning's loop, the RNG right before training continues.
        """
        if weights_only is False:
            raise ValueError(
                "MMFSDP2Strategy loads checkpoints weights_only (no pickled code is run); "
                "weights_only=False is not supported"
            )
        self._check_checkpoint_io()
        self.wait_for_checkpoint()
        lm = self.lightning_module
        assert lm is not None
        path = self.broadcast(str(checkpoint_path))
        path = path if ckpt.remote.is_url(path) else Path(path)
        fitting = lm.trainer.state.fn == TrainerFn.FITTING
        strict = lm.strict_loading if self._strict_loading is None else self._strict_loading
        loaded = checkpoint.load(
            path,
            lm,
            self.optimizers if fitting else [],
            strict=strict,
            rank=self.global_rank,
            world_size=self.world_size,
            fitting=fitting,
            view=self._expert_view("model"),
            optimizer_view=self._expert_view("optimizer"),
            schedulers=[c.scheduler for c in self.lr_scheduler_configs],
            source=ckpt.remote.open_source(path, self._storage_options) if isinstance(path, str) else None,
        )
        self._pending_rng, self._pending_rng_point = loaded.rng, loaded.rng_point
        self._pending_rng_step = loaded.checkpoint.get("global_step")
        return loaded.checkpoint

    def _restore_pending_rng(self) -> None:
        trainer = attached_trainer(self.lightning_module)
        # Only for the step right after the checkpoint: never into a later, unrelated run of this strategy.
        if self._pending_rng is not None and (trainer is None or trainer.global_step == self._pending_rng_step):
            checkpoint.restore_rng(self._pending_rng, self.root_device)
        self._pending_rng = self._pending_rng_point = None

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Resuming at an epoch boundary: restore the RNG before the new epoch's training iterator is created."""
        trainer = attached_trainer(self.lightning_module)
        if (
            self._pending_rng is not None
            and self._pending_rng_point == "next_epoch"
            and trainer is not None
            and trainer.training
            and not trainer.sanity_checking
        ):
            self._restore_pending_rng()
        return dataloader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Resuming mid-epoch: restore the RNG right before the first batch after the checkpoint."""
        self._async_saver.poll()  # a background save that completed: its links and deferred removals now
        if self._pending_rng is not None:
            self._restore_pending_rng()

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Delete a checkpoint (rank 0): a directory is moved out of sight before it is deleted. While a save runs in
        the background, the deletion waits until it is complete (ModelCheckpoint's ``save_top_k`` removes the worst
        checkpoint right after starting the save of a better one), so a crash never leaves fewer checkpoints."""
        if not self.is_global_zero:
            return
        if ckpt.remote.is_url(str(filepath)):
            ckpt.remote.remove(str(filepath), self._storage_options)
        elif not self._async_saver.defer_removal(Path(filepath)):
            checkpoint.remove(Path(filepath))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="FSDP2 driven by a MindSpeed MM fsdp2_config.yaml"
            )
