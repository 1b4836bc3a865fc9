"""The strategy's side of context parallelism: check the settings, build the ``(dp, cp)`` mesh, route the model.

Kept out of ``fsdp2.py`` so that the strategy only calls :class:`ContextParallelSetup` at three points: the
arguments (``__init__``), the processes (``setup_environment``) and the model (``_shard``, before ``fully_shard``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.context_parallel import (
    ContextParallelError,
    ContextParallelPlan,
    canonical_algorithm,
    context_parallel_plan,
)
from lightning_mm.core.parallel_layout import LayoutMeshes, context_parallel_algorithm

__all__ = ["ContextParallelSetup"]


class ContextParallelSetup:
    """``MMFSDP2Strategy(context_parallel_size=C, context_parallel_algo=...)`` from arguments to a routed model."""

    def __init__(self, size: int, algo: str | None) -> None:
        context_parallel_plan(size if isinstance(size, int) and size > 0 else 1, size, algo or "ulysses")  # errors now
        self.size, self.algo_argument = size, algo
        self.algo = canonical_algorithm(algo or "ulysses")
        self.plan: ContextParallelPlan | None = None
        self.mesh: Any = None
        self.group: Any = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def setup(self, meshes: LayoutMeshes, config: FSDP2Config) -> None:
        """Take ``C`` from the run's layout (the YAML key ``context_parallel_size``, or this strategy argument,
        its alias), the algorithm from ``context_parallel_algo`` (key or argument) and the ``(dp, cp)`` mesh from
        the layout's mesh builder (every rank calls this)."""
        self.size = meshes.layout.cp
        self.algo = context_parallel_algorithm(config, self.algo_argument)
        self.plan = context_parallel_plan(meshes.layout.world_size, self.size, self.algo, meshes.layout.tp)
        if self.enabled:
            self.mesh = meshes.context_parallel
            self.group = self.mesh.get_group("cp")

    def sampler_kwargs(self, global_rank: int) -> dict[str, Any]:
        assert self.plan is not None
        return {"num_replicas": self.plan.data_parallel_size, "rank": self.plan.data_parallel_rank(global_rank)}

    def refuse_prediction(self, root: nn.Module) -> None:
        """``trainer.predict`` under context parallelism would return each rank's slice of the sequence: refuse it
        before any batch (a model that handles context parallelism itself gathers what it returns)."""
        if self.enabled and not getattr(root, "handles_context_parallel", False):
            raise ContextParallelError(
                f"context_parallel_size {self.size}: trainer.predict would return each rank's 1/{self.size} slice "
                "of the sequence; predict with context_parallel_size=1 (checkpoints load without context "
                "parallelism)"
            )

    def apply(self, root: nn.Module, target: nn.Module) -> None:
        """Route the model's attention through Ulysses, or refuse a model whose attention cannot be routed.

        A LightningModule with ``handles_context_parallel = True`` runs its own attention through
        :func:`~lightning_mm.core.context_parallel.ulysses_attention`; otherwise the Transformers model in
        ``target`` is routed (:func:`~lightning_mm.hf.cp_attention.enable_context_parallel`).
        """
        if not self.enabled:
            return
        assert self.plan is not None
        rank_zero_info(self.plan.describe())
        if getattr(root, "handles_context_parallel", False):
            if self.algo != "ulysses":
                raise ContextParallelError(
                    f"context_parallel_algo {self.algo}: {type(root).__name__} runs its own (Ulysses) context-parallel "
                    "attention (handles_context_parallel); use context_parallel_algo ulysses"
                )
            return
        from lightning_mm.hf.cp_attention import enable_context_parallel, find_hf_model

        model = find_hf_model(target)
        if model is None:
            raise ContextParallelError(
                f"context_parallel_size {self.size}: the attention of {type(target).__name__} cannot be routed "
                "(no Transformers model in it). For a custom model, split the batch with "
                "lightning_mm.core.context_parallel.split_sequence, run attention through ulysses_attention, "
                "compute the loss with context_parallel_loss, and set `handles_context_parallel = True` on the "
                "LightningModule"
            )
        enable_context_parallel(model, self.group, self.algo)
