"""The training setups compared by the step-time benchmark: one sharding plan, four ways to run it.

* ``mm_fsdp2``: :class:`~lightning_mm.MMFSDP2Strategy` driven by the FSDP2 YAML (as a dict here).
* ``hand_fsdp2``: the same plan written by hand with ``fully_shard`` in ``configure_model`` under Lightning's
  ``ModelParallelStrategy`` (data parallel over both ranks), the way Lightning's and torchtitan's docs show it.
* ``fsdp1``: Lightning's ``FSDPStrategy`` (FSDP1, FULL_SHARD) auto-wrapping the same modules.
* ``ddp``: Lightning's ``DDPStrategy``, every parameter replicated.
* ``mm_module`` (not in the default comparison): ``mm_fsdp2`` with the model in an ``MMLightningModule``, as a
  migrated MindSpeed MM user writes it: its default AdamW and per-step metrics, Lightning's default
  ``log_every_n_steps=50``. It measures the module's own per-step cost (variant ``@before_lazylog``).

Two models: ``lm``, the small decoder-only transformer of :mod:`common` (plan: every block is a unit, the rest
is the root; fp32), and ``vlm``, the seed's TinyVLM with the seed's ``fsdp2_config.yaml`` verbatim (bf16
parameters, fp32 reduction, ``image_encoder`` ignored, decoder layers recomputed, prefetch 2/2). For ``vlm`` each
contender gets the closest equivalent it has; the differences are listed in :data:`VLM_NOTES`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import yaml
from common import ROOT, Block, CaptionData, DecoderLM, LMConfig, lm_loss, token_batches
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from model import TinyVLM, TinyVLMConfig
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader

from lightning_mm import MMFSDP2Strategy, MMLightningModule
from lightning_mm.core.optimizer import group_by_sharding

CONTENDERS = ("mm_fsdp2", "hand_fsdp2", "fsdp1", "ddp", "mm_module")
SEED_YAML = ROOT / "examples" / "custom_model" / "fsdp2_config.yaml"

VLM_NOTES = {
    "hand_fsdp2": "same units, dtypes, ignored image_encoder (its gradients all-reduced in one flat collective in "
    "on_after_backward), reentrant checkpoint_wrapper on the decoder layers, prefetch 2/2 in the known "
    "execution order; the root does not cast inputs (the ignored fp32 image encoder takes them)",
    "fsdp1": "auto-wrap of the same modules, MixedPrecision(bf16, reduce fp32, root inputs not cast), "
    "ignored_states=image_encoder (gradients all-reduced as for hand_fsdp2), reentrant activation "
    "checkpointing of the decoder layers, forward_prefetch=True",
    "ddp": "no sharding: precision='bf16-mixed' (autocast) instead of bf16 parameters, no recomputation",
}


@dataclass
class Sizes:
    """Model and batch sizes of one benchmark run."""

    lm: LMConfig
    vlm: TinyVLMConfig
    batch_size: int = 8
    vlm_seq: int = 32


PRESETS = {
    # Per-step Lightning and FSDP overhead dominates: the setting where a strategy's own cost shows most.
    "tiny": lambda: Sizes(
        lm=LMConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, seq_len=32),
        vlm=TinyVLMConfig(),
        batch_size=4,
        vlm_seq=12,
    ),
    "small": lambda: Sizes(
        lm=LMConfig(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, seq_len=64),
        vlm=TinyVLMConfig(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4),
    ),
    "medium": lambda: Sizes(
        lm=LMConfig(), vlm=TinyVLMConfig(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4), vlm_seq=64
    ),
}


def default_sizes(preset: str = "small") -> Sizes:
    """Model and batch sizes by preset name: ``tiny``, ``small`` (the default) or ``medium``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown size preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[preset]()


# ----------------------------------------------------------------------------------------- modules
class LMTask(L.LightningModule):
    """The decoder-only LM; built in ``configure_model`` (meta device where the strategy wants it)."""

    def __init__(self, cfg: LMConfig, lr: float = 1e-4) -> None:
        super().__init__()
        self.cfg, self.lr = cfg, lr
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = DecoderLM(self.cfg)
            self.parallelize()

    def parallelize(self) -> None:
        """Hand-written sharding (only the ``hand_fsdp2`` subclass does any)."""

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        loss = lm_loss(self.model, batch[0])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class MMTask(MMLightningModule):
    """A model of ``cfg`` in an MMLightningModule: its default AdamW (lr 1e-4) and metrics."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(lr=1e-4)
        self.cfg = cfg


class MMLMTask(MMTask):
    """The LM as a migrated MindSpeed MM user writes it: the seed's hooks."""

    def model_provider(self) -> nn.Module:
        return DecoderLM(self.cfg)

    def get_batch(self, batch: Any) -> torch.Tensor:
        return batch[0]

    def forward_step(self, input_ids: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, input_ids)


class MMVLMTask(MMTask):
    """TinyVLM (its forward returns ``{"loss": ...}``, which the default hooks take)."""

    def model_provider(self) -> nn.Module:
        return TinyVLM(self.cfg)


class HandLMTask(LMTask):
    """The plan of ``lm_fsdp2_config()`` written by hand: each block, then the model, ``fully_shard``-ed."""

    def parallelize(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class VLMTask(L.LightningModule):
    """TinyVLM on captions. ``eager=True`` builds the model in ``__init__`` (the contenders that need it then)."""

    def __init__(self, cfg: TinyVLMConfig, lr: float = 1e-4, eager: bool = False) -> None:
        super().__init__()
        self.cfg, self.lr = cfg, lr
        self.model: nn.Module | None = TinyVLM(cfg) if eager else None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = TinyVLM(self.cfg)
        self.parallelize()

    def parallelize(self) -> None:
        """Hand-written sharding (only the ``hand_fsdp2`` subclass does any)."""

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        loss = self.model(**batch)["loss"]
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # As MMLightningModule's default optimiser: sharded and unsharded (the ignored image encoder's) parameters
        # in groups of their own (one group where all are of one kind: FSDP1's flat parameters, DDP).
        return torch.optim.AdamW(group_by_sharding(self.parameters()), lr=self.lr)


def _all_reduce_flat(params: list[nn.Parameter]) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class IgnoredGradSync(VLMTask):
    """What a hand-written FSDP setup must add for a trainable ignored module: average its gradients."""

    def on_after_backward(self) -> None:
        _all_reduce_flat(list(self.model.image_encoder.parameters()))


class HandVLMTask(IgnoredGradSync):
    """The seed YAML's plan written by hand with ``fully_shard``."""

    def parallelize(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        if getattr(self, "_parallelized", False):
            return
        self._parallelized = True
        mesh = self.device_mesh["data_parallel"]
        dec = self.model.text_decoder
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ignored = set(self.model.image_encoder.parameters())
        kw = dict(mesh=mesh, mp_policy=mp, ignored_params=ignored)
        for i, layer in enumerate(dec.decoder.layers):
            dec.decoder.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.REENTRANT)
        for module in (dec.output_layer, dec.embedding, *dec.decoder.layers):
            fully_shard(module, **kw)
        root_mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        fully_shard(self.model, mesh=mesh, mp_policy=root_mp, ignored_params=ignored)
        order = [dec.embedding, *dec.decoder.layers, dec.output_layer]
        for i, unit in enumerate(order):
            unit.set_modules_to_forward_prefetch(order[i + 1 : i + 3])
        reverse = order[::-1]
        for i, unit in enumerate(reverse):
            unit.set_modules_to_backward_prefetch(reverse[i + 1 : i + 3])


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU.

    Lightning refuses the exact class on a CPU accelerator and hands FSDP1 ``device_id=None`` there, which FSDP1
    rejects without an accelerator; FSDP1 itself runs on CPU when given ``device_id=cpu``. Lightning wraps the
    layers to recompute with torch's default checkpoint wrapper (non-reentrant); ``reentrant=True`` wraps them
    reentrant instead, like the other contenders (the seed's ``use_reentrant`` default). Everything else (the
    auto-wrap policy, mixed precision, the training loop) is Lightning's.
    """

    def __init__(self, *args: Any, reentrant: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reentrant = reentrant

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        if self._activation_checkpointing_kwargs:
            impl = CheckpointImpl.REENTRANT if self.reentrant else CheckpointImpl.NO_REENTRANT
            apply_activation_checkpointing(
                model,
                checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
                **self._activation_checkpointing_kwargs,
            )
        return model


def _vlm_units(model: TinyVLM) -> set[nn.Module]:
    dec = model.text_decoder
    return {dec.embedding, dec.output_layer, *dec.decoder.layers}


# ------------------------------------------------------------------------------------------ configs
def lm_fsdp2_config() -> dict[str, Any]:
    """The LM's plan as the YAML a user would write (paths relative to the LightningModule)."""
    return {"sharding_size": "auto", "sub_modules_to_wrap": ["model.layers.{*}"]}


def seed_fsdp2_config() -> dict[str, Any]:
    """The seed's fsdp2_config.yaml verbatim, its module paths prefixed by ``model.`` (the LightningModule's)."""
    data = yaml.safe_load(SEED_YAML.read_text())
    for key in ("sub_modules_to_wrap", "ignored_modules", "recompute_modules"):
        data[key] = [f"model.{p}" for p in data.get(key) or []]
    return data


@dataclass
class Setup:
    strategy: Any
    module: L.LightningModule
    precision: str
    loader: DataLoader
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)  # over common.quiet_trainer_kwargs()


def loader_for(model: str, sizes: Sizes, steps: int, world: int = 2) -> DataLoader:
    samples = sizes.batch_size * steps * world
    if model == "lm":
        data = token_batches(sizes.lm, samples)
    else:
        data = CaptionData(samples, sizes.vlm_seq, sizes.vlm.vocab_size, sizes.vlm.image_size)
    return DataLoader(data, batch_size=sizes.batch_size, shuffle=False)


def build(
    model: str,
    contender: str,
    sizes: Sizes,
    steps: int,
    mm_config: dict[str, Any] | None = None,
    mm_kwargs: dict[str, Any] | None = None,
) -> Setup:
    """One contender's strategy, LightningModule and precision for ``model`` (``lm`` or ``vlm``)."""
    loader = loader_for(model, sizes, steps)
    if contender == "mm_module":  # MMLightningModule: YAML paths are relative to its model; Lightning's log interval
        if model == "lm":
            cfg = (
                mm_config if mm_config is not None else {"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}
            )
            module: L.LightningModule = MMLMTask(sizes.lm)
        else:
            cfg = mm_config if mm_config is not None else yaml.safe_load(SEED_YAML.read_text())
            module = MMVLMTask(sizes.vlm)
        return Setup(
            MMFSDP2Strategy(cfg, **(mm_kwargs or {})),
            module,
            "32-true",
            loader,
            trainer_kwargs={"log_every_n_steps": 50},
        )
    if model == "lm":
        if contender == "mm_fsdp2":
            cfg = mm_config if mm_config is not None else lm_fsdp2_config()
            return Setup(MMFSDP2Strategy(cfg, **(mm_kwargs or {})), LMTask(sizes.lm), "32-true", loader)
        if contender == "hand_fsdp2":
            strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
            return Setup(strategy, HandLMTask(sizes.lm), "32-true", loader)
        if contender == "fsdp1":
            strategy = CPUFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
            return Setup(strategy, LMTask(sizes.lm), "32-true", loader)
        if contender == "ddp":
            return Setup(DDPStrategy(), LMTask(sizes.lm), "32-true", loader)
    elif model == "vlm":
        if contender == "mm_fsdp2":
            cfg = mm_config if mm_config is not None else seed_fsdp2_config()
            return Setup(MMFSDP2Strategy(cfg, **(mm_kwargs or {})), VLMTask(sizes.vlm), "32-true", loader)
        if contender == "hand_fsdp2":
            strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
            return Setup(strategy, HandVLMTask(sizes.vlm, eager=True), "32-true", loader)
        if contender == "fsdp1":
            from torch.distributed.fsdp import MixedPrecision
            from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

            module = IgnoredGradSync(sizes.vlm, eager=True)
            units = _vlm_units(module.model)
            layers = set(module.model.text_decoder.decoder.layers)
            strategy = CPUFSDPStrategy(
                auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m in units),
                activation_checkpointing_policy=functools.partial(
                    lambda_auto_wrap_policy, lambda_fn=lambda m: m in layers
                ),
                mixed_precision=MixedPrecision(
                    param_dtype=torch.bfloat16,
                    reduce_dtype=torch.float32,
                    buffer_dtype=torch.float32,
                    cast_root_forward_inputs=False,
                ),
                ignored_states=[module.model.image_encoder],
                sharding_strategy="FULL_SHARD",
                forward_prefetch=True,
                reentrant=True,
            )
            return Setup(strategy, module, "32-true", loader)
        if contender == "ddp":
            return Setup(DDPStrategy(), VLMTask(sizes.vlm, eager=True), "bf16-mixed", loader)
    raise ValueError(f"unknown model/contender {model!r}/{contender!r}")
