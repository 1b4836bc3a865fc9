"""The arithmetic of MindSpeed MM's global batch size: ``global = micro batch x data-parallel ranks x accumulation``.

Lightning-free (``lightning-mm migrate`` imports it; so does the ``GlobalBatchSize`` callback)."""

from __future__ import annotations

from lightning_mm.errors import ConfigError

__all__ = ["accumulation_for"]


def accumulation_for(global_batch_size: int, micro_batch_size: int, world_size: int, context_parallel: int = 1) -> int:
    """Micro-batches each data-parallel rank accumulates per optimizer step; a :class:`ConfigError` with the
    arithmetic when ``global_batch_size`` is not a multiple of micro batch x data-parallel ranks."""
    data_parallel = world_size // context_parallel  # the ranks of a context-parallel group share their samples
    per_step = micro_batch_size * data_parallel
    if global_batch_size % per_step:
        raise ConfigError(
            f"global batch size {global_batch_size} cannot be kept on {world_size} ranks: micro batch "
            f"{micro_batch_size} x {data_parallel} data-parallel ranks = {per_step} samples per micro-step, and "
            f"{global_batch_size} is not a multiple of {per_step}; run on a world size whose data-parallel ranks "
            f"divide {global_batch_size // micro_batch_size if global_batch_size % micro_batch_size == 0 else '?'}, "
            "or change the global batch size"
        )
    return global_batch_size // per_step
