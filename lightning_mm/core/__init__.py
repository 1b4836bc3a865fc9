"""The FSDP2 core, free of Lightning: deciding and doing, usable without a Trainer.

Deciding: :mod:`~lightning_mm.core.config` (the YAML as a typed ``FSDP2Config``), :mod:`~lightning_mm.core.patterns`
and :mod:`~lightning_mm.core.sharding_plan` (a pure ``ShardingPlan`` from the config and a meta model), and
:mod:`~lightning_mm.core.memory` (estimates). Doing: :mod:`~lightning_mm.core.apply` (recomputation, ``fully_shard``,
prefetch, materialisation), :mod:`~lightning_mm.core.torch_init`, :mod:`~lightning_mm.core.grad_clip`,
:mod:`~lightning_mm.core.optimizer`, :mod:`~lightning_mm.core.expert_parallel` and
:mod:`~lightning_mm.core.context_parallel`. Nothing here imports Lightning, Transformers or the layers above.
"""
