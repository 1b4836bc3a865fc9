"""MMFSDP2Strategy: MindSpeed MM's YAML-driven FSDP2 as a Lightning strategy (the lifecycle).

The strategy is Lightning's lifecycle around helpers that each own one concern: the run's config, plan and applied
sharding (:class:`~lightning_mm.core.sharded_run.ShardedRun`, Lightning-free), the process group
(:mod:`~lightning_mm.strategies.process_group`), checkpoints (:mod:`~lightning_mm.strategies.checkpoints`),
stopping on signals and lost peers (:mod:`~lightning_mm.strategies.stopping`), context parallelism
(:mod:`~lightning_mm.strategies.cp_setup`), precision (:mod:`~lightning_mm.strategies.precision`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mm import checkpoint
from lightning_mm._compat import _PATH, _sync_ddp_if_available, attached_trainer, set_device_mesh
from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.grad_mode import leave_inference_mode, outside_inference_mode
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.core.optimizer import FusedSteps
from lightning_mm.core.parallel_layout import config_layout
from lightning_mm.core.sharded_run import PlannedRun, ShardedRun, data_parallel_sampler_kwargs, plan_run
from lightning_mm.core.sharding_plan import ShardingPlan
from lightning_mm.errors import InputTypeError, StateError
from lightning_mm.strategies import setup_checks, stopping
from lightning_mm.strategies.checkpoints import StrategyCheckpoints
from lightning_mm.strategies.cp_setup import ContextParallelSetup
from lightning_mm.strategies.launch import checking_launcher
from lightning_mm.strategies.precision import MMFSDP2Precision, as_mm_precision
from lightning_mm.strategies.process_group import ProcessGroupOwner

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MMFSDP2Strategy"]


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
            DTensor parameters one by one; see ``lightning_mm.core.optimizer``). The choice is logged, and applied
            only while each step computes its update: the groups, ``optimizer.state_dict()``, ``optimizer_state``
            and checkpoints keep the values given (``fused`` stays unset). ``False`` leaves the implementation
            to torch.
        stop_timeout: seconds within which a signalled rank (SIGTERM, SIGINT) ends, whatever its main thread is
            doing, and the other ranks stop when one rank process is gone (a SIGTERM, a crash, a kill), see
            ``lightning_mm.strategies.stopping``; a positive finite number. A rank stopped by SIGTERM exits with
            status 143.
        context_parallel_size: ``C`` > 1 turns on Ulysses context parallelism: ``C`` consecutive ranks share
            samples, each holding ``seq / C`` tokens (see ``lightning_mm.core.context_parallel``).
            Parameters stay sharded over all ranks; the sampler runs over ``world / C`` data-parallel ranks.
        context_parallel_algo: ``"ulysses"`` (the default) or ``"kv_allgather"`` (any head count, zig-zag causal
            load balance; ``lightning_mm.core.ring_attention``); MindSpeed MM's ``ulysses_cp_algo`` and
            ``megatron_cp_algo`` are accepted as these. An alias of the FSDP2 config key of that name.
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
        context_parallel_algo: str | None = None,
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
        from lightning_mm.mindspeed.load import fsdp2_config as read_fsdp2_config  # also MindSpeed MM's native form

        self.sharded_run = ShardedRun(
            read_fsdp2_config(fsdp2_config) if fsdp2_config is not None else None, read=read_fsdp2_config
        )
        """The run's config, plan and applied sharding (Lightning-free)."""
        self.checkpoints = StrategyCheckpoints(
            checkpoint_format, save_ckpt_dtype, storage_options, async_save, strict_loading
        )
        """Checkpoint options and the state between saves and loads."""
        self.timeout = timeout
        """The process-group timeout."""
        self._process_group = ProcessGroupOwner(timeout, process_group_backend)
        self._empty_init = empty_init
        self.num_nodes = 1
        self._fused_optimizer_step = fused_optimizer_step
        self.fused_steps = FusedSteps()
        """Which optimizer groups take torch's fused step (``fused_optimizer_step``), applied in
        :meth:`optimizer_step` without writing into the groups (``lightning_mm.core.optimizer``)."""
        self._runs = stopping.StrategyRuns(stop_timeout)
        self._context_parallel = ContextParallelSetup(context_parallel_size, context_parallel_algo)
        if not isinstance(stop_on_nonfinite, bool):
            raise InputTypeError(f"stop_on_nonfinite must be True or False, got {stop_on_nonfinite!r}")
        self.stop_on_nonfinite = stop_on_nonfinite

    # ------------------------------------------------------------------------------------ properties
    @property
    def fsdp2_config(self) -> FSDP2Config:
        """The config in force (known once the LightningModule is attached)."""
        return self.sharded_run.config_for(self.lightning_module)

    @property
    def given_config(self) -> FSDP2Config | None:
        """The config given to the strategy itself (``None``: the LightningModule's or the default is used)."""
        return self.sharded_run.given

    @property
    def plan(self) -> ShardingPlan:
        """The sharding plan applied at setup."""
        return self.sharded_run.plan

    @property
    def checkpoint_format(self) -> str:
        """``MMFSDP2Strategy(checkpoint_format=...)``; may be changed between saves."""
        return self.checkpoints.checkpoint_format

    @checkpoint_format.setter
    def checkpoint_format(self, value: str) -> None:
        self.checkpoints.checkpoint_format = value

    @property
    def context_parallel_group(self) -> Any:
        """The context-parallel process group of this rank (``None`` when ``context_parallel_size`` is 1)."""
        return self._context_parallel.group

    @property
    def context_parallel_size(self) -> int:
        return self._context_parallel.size

    @property
    def context_parallel_algo(self) -> str:
        return self._context_parallel.algo

    @property
    def requested_context_parallel_algo(self) -> str | None:
        """The ``context_parallel_algo`` argument as given (``None``: the FSDP2 YAML's, or the default, decides)."""
        return self._context_parallel.algo_argument

    @property
    def device_mesh(self) -> DeviceMesh:
        if self.sharded_run.mesh is None:
            raise StateError("The device mesh exists once the processes are initialised (`setup_environment`).")
        return self.sharded_run.mesh

    @property
    def stop_timeout(self) -> float:
        """``MMFSDP2Strategy(stop_timeout=...)`` in seconds."""
        return self._runs.stop_timeout

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
        return self._process_group.backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._context_parallel.enabled:  # the ranks of a context-parallel group read the same samples
            return self._context_parallel.sampler_kwargs(self.global_rank)
        return data_parallel_sampler_kwargs(self.device_mesh)

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
        self._precision_plugin = as_mm_precision(plugin)

    # ------------------------------------------------------------------------------------- launching
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.given_config is not None:
            world = self.num_nodes * self.num_processes
            cp = self._context_parallel  # fail before launching
            config_layout(self.given_config, world, cp.size, cp.algo_argument)
        # Both kinds check ckpt_path="last" first (lightning_mm.strategies.launch).
        self._launcher = checking_launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Lightning's own strategies set the rank this way (an attribute Lightning puts on the decorator).
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        trainer = attached_trainer(self.lightning_module)
        setup_checks.refuse_unsupported_callbacks(trainer)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:  # what a save would refuse, refused now
            logger_dir = trainer.loggers[0].save_dir if trainer.loggers else None
            self.checkpoints.refuse_at_urls(trainer.checkpoint_callbacks, logger_dir or trainer.default_root_dir)
        self._runs.start(self.cluster_environment, self._launcher)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        root = self.lightning_module
        assert self.cluster_environment is not None and root is not None
        config = self.fsdp2_config
        env, rank, world, device = self.cluster_environment, self.global_rank, self.world_size, self.root_device
        self._process_group.start(env, rank, world, device, self.num_nodes, config.offload_to_cpu)
        cp_argument = self._context_parallel.size
        set_device_mesh(root, self.sharded_run.build_mesh(config, world, device.type, cp_argument))
        assert self.sharded_run.meshes is not None
        self._context_parallel.setup(self.sharded_run.meshes, config)

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

    def plan_for(self, root: nn.Module, world_size: int) -> PlannedRun:
        """What :meth:`setup` decides for ``root`` on ``world_size`` ranks: the precision plugin's conversion of
        the module (``*-true``), then the config in force, the precision policy and the plan. ``lightning-mm plan``
        calls this: the plan it prints is the plan the strategy applies."""
        converted = self.precision_plugin.convert_module(root)
        assert converted is root
        precision = str(self.precision_plugin.precision)
        keep = self.sharded_run.keep_unsharded_for_backward
        planned = plan_run(
            self.given_config, root, world_size, precision, keep_unsharded_for_backward=keep, read=self.sharded_run.read
        )
        return planned

    @override
    @outside_inference_mode
    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model (and set up optimisers when fitting); outside a caller's ``torch.inference_mode``."""
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        root = self.lightning_module
        assert root is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if trainer.state.fn == TrainerFn.PREDICTING:
            self._context_parallel.refuse_prediction(root)
        if fitting:  # as in setup_environment, with the directories ModelCheckpoint.setup has resolved
            self.checkpoints.refuse_at_urls(trainer.checkpoint_callbacks)
        if not isinstance(root, FSDPModule):
            if fitting and self._layer_sync is not None:
                setup_checks.convert_sync_batchnorm(self._layer_sync, root, self.root_device)
            self._shard(root)
        if fitting:
            self.checkpoints.refuse_unsavable_model(self)
        self.barrier()
        if fitting:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            self.fused_steps = FusedSteps()
            if self._fused_optimizer_step:
                setup_checks.choose_fused_optimizer_steps(self.fused_steps, self.optimizers)
        if isinstance(self.precision_plugin, MMFSDP2Precision):
            self.precision_plugin.stop_on_nonfinite = self.stop_on_nonfinite
        self.setup_precision_plugin()

    def _shard(self, root: pl.LightningModule) -> None:
        """Plan (:meth:`plan_for`), log the plan, route context parallelism, apply the plan."""
        planned = self.plan_for(root, self.world_size)
        rank_zero_info(planned.plan.describe())
        self._context_parallel.apply(root, planned.target)
        self.sharded_run.apply(root, planned, self.device_mesh, self.root_device)
        if planned.config.encoder_dp_balance:  # after recomputation and sharding: the outermost tower forward
            from lightning_mm.hf.vision_tower_balance import enable_from_config

            enable_from_config(planned.target, planned.config)
        if isinstance(self.precision_plugin, MMFSDP2Precision):  # gradient norms: local experts summed over EP
            self.precision_plugin.norm_groups = self.sharded_run.norm_groups

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

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any | None = None, **kwargs: Any
    ) -> Any:
        """Lightning's step; the groups chosen for torch's fused step read ``fused=True`` for the update only."""
        with self.fused_steps.step(optimizer, closure) as step_closure:
            return super().optimizer_step(optimizer, step_closure, model, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no reduce-scatter (and no ignored-gradient all-reduce) until the last micro-batch."""
        assert self.lightning_module is not None
        with self.sharded_run.no_gradient_sync(self.lightning_module):
            yield

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.sharded_run.after_backward()

    @override
    def model_to_device(self) -> None:
        pass  # placement is part of sharding and materialisation

    # ----------------------------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if self.is_global_zero:  # ModelCheckpoint links `last` and then calls this: never to a pending checkpoint
            self.checkpoints.saver.hide_links()
        self._process_group.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._process_group.broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----------------------------------------------------------------------------------- lifecycle
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
        self._runs.install_signal_handler()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._runs.fail(exception)

    @override
    def teardown(self) -> None:
        """Release the accelerator; after a failed run, also destroy the process group this strategy created
        (``lightning_mm.strategies.process_group``)."""
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.checkpoints.end(self._runs.failed, self.stop_timeout)
        if self._runs.failed:
            self._process_group.end_failed_run()
        self._runs.end()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ----------------------------------------------------------------------------------- checkpoints
    # lightning_mm.strategies.checkpoints. Every entry point leaves inference mode: DTensor state dicts cannot be
    # taken or loaded under it.
    @override
    @checkpoint.outside_inference_mode
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards (``torch_dcp``), or the gathered state on rank 0 (``torch``)."""
        lm = self.lightning_module
        assert lm is not None
        return checkpoint.model_state(lm, full=self.checkpoints.full, view=self.sharded_run.expert_view(lm, "model"))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint, which checks the keys

    @override
    @checkpoint.outside_inference_mode
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's shards keyed by parameter name (``torch_dcp``), or the gathered state on rank 0 in torch's
        layout, keyed by parameter index with the names alongside (``torch``)."""
        lm = self.lightning_module
        assert lm is not None
        view = self.sharded_run.expert_view(lm, "optimizer")
        return checkpoint.optimizer_state(lm, optimizer, full=self.checkpoints.full, view=view)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in place by load_checkpoint

    @override
    @checkpoint.outside_inference_mode
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write a checkpoint with every rank (``torch_dcp``) or from rank 0 (``torch``); visible once complete."""
        target = self.broadcast(str(filepath))
        self.checkpoints.check_call(self._checkpoint_io)
        self.checkpoints.save(self, checkpoint, target, storage_options)

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background (``async_save=True``) is in place; raise what
        its write raised. Nothing to do without one."""
        self.checkpoints.wait()

    @override
    @checkpoint.outside_inference_mode
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and (when fitting) optimiser state in place, with strict key checks; return the rest.

        Per-rank state (RNG, dataloader position) is restored when the world size is unchanged: the dataloader
        position through Lightning's loop, the RNG right before training continues.
        """
        self.checkpoints.check_call(self._checkpoint_io, weights_only)
        return self.checkpoints.load(self, self.broadcast(str(checkpoint_path)))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Resuming at an epoch boundary: restore the RNG before the new epoch's training iterator is created."""
        self.checkpoints.restore_rng_before_epoch(self.lightning_module, self.root_device)
        return dataloader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Resuming mid-epoch: restore the RNG right before the first batch after the checkpoint."""
        self.checkpoints.saver.poll()  # a background save that completed: its links and deferred removals now
        self.checkpoints.restore_rng_before_batch(self.lightning_module, self.root_device)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Delete a checkpoint (rank 0): a directory is moved out of sight before it is deleted. While a save runs in
        the background, the deletion waits until it is complete (ModelCheckpoint's ``save_top_k`` removes the worst
        checkpoint right after starting the save of a better one), so a crash never leaves fewer checkpoints."""
        if self.is_global_zero:
            self.checkpoints.remove(str(filepath))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="FSDP2 driven by a MindSpeed MM fsdp2_config.yaml"
            )
