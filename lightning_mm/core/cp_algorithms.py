"""The context-parallel algorithms and their names (MindSpeed MM's accepted): no imports, so that the config, the
layout and the algorithms can all check ``context_parallel_algo``."""

from __future__ import annotations

from typing import Any

from lightning_mm.errors import ConfigError

__all__ = ["ALGORITHMS", "ALGORITHM_NAMES", "ContextParallelError", "canonical_algorithm"]


class ContextParallelError(ConfigError):
    """A context-parallel setting that cannot work (raised at setup)."""


ALGORITHMS = ("ulysses", "kv_allgather")
ALGORITHM_NAMES = {
    "ulysses_cp_algo": "ulysses",
    "megatron_cp_algo": "kv_allgather",
    "kvallgather_cp_algo": "kv_allgather",
}
"""MindSpeed MM's names (``--context-parallel-algo``; ``kvallgather_cp_algo`` is MindSpeed's) -> this project's.
``megatron_cp_algo`` is ring attention there: the same attention and the same load-balanced layout, computed here by
gathering keys and values instead of passing them around the ring (:mod:`~lightning_mm.core.ring_attention`)."""


def canonical_algorithm(algo: Any) -> str:
    """``algo`` as this project names it (MindSpeed MM's names accepted, :data:`ALGORITHM_NAMES`); an unknown or
    unsupported name is a :class:`ContextParallelError` naming the key."""
    name = ALGORITHM_NAMES.get(algo, algo) if isinstance(algo, str) else algo
    if name == "hybrid_cp_algo":
        raise ContextParallelError(
            "context_parallel_algo 'hybrid_cp_algo' (Ulysses inside ring attention) is not supported; choose "
            "'ulysses_cp_algo' (heads divisible by the size) or 'megatron_cp_algo' (any head count)"
        )
    if name not in ALGORITHMS:
        raise ContextParallelError(
            f"context_parallel_algo {algo!r} is not supported; choose one of {ALGORITHMS} (MindSpeed MM's "
            f"{tuple(ALGORITHM_NAMES)} are accepted as {tuple(ALGORITHM_NAMES.values())})"
        )
    return str(name)
