"""Variants of ``mm_fsdp2`` for before/after measurements of the strategy's tuned defaults.

A contender named ``mm_fsdp2@VARIANT`` runs MMFSDP2Strategy with one change: a config override (what a user
could write in the YAML), a strategy argument, or, for ``before_keep`` and ``before_lazylog``, the behaviour before
a tuning change, restored for that run only (a patch of the benchmark process, never of the package).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning_mm import MMLightningModule
from lightning_mm.core.sharded_run import ShardedRun

VARIANTS: dict[str, str] = {
    "": "the strategy as it is",
    "before_keep": "before: the root and the last unit are resharded after forward like every other unit "
    "(build_plan(..., keep_unsharded_for_backward=False))",
    "fwd0": "num_to_forward_prefetch: 0",
    "fwd1": "num_to_forward_prefetch: 1",
    "fwd2": "num_to_forward_prefetch: 2",
    "bwd2": "num_to_backward_prefetch: 2",
    "noreshard": "reshard_after_forward: false (ZeRO-2)",
    "nocast": "cast_forward_inputs: false",
    "nonreentrant": "use_reentrant: false (non-reentrant recomputation)",
    "before_lazylog": "before: MMLightningModule computes and synchronises its throughput and gradient-norm metrics "
    "every step, not only on the steps whose logs are written (mm_module only)",
    "before_fused": "before: torch chooses the optimiser step's implementation (a per-parameter loop over DTensors on "
    "CPU): MMFSDP2Strategy(fused_optimizer_step=False)",
}

_OVERRIDES: dict[str, dict[str, Any]] = {
    "fwd0": {"num_to_forward_prefetch": 0},
    "fwd1": {"num_to_forward_prefetch": 1},
    "fwd2": {"num_to_forward_prefetch": 2},
    "bwd2": {"num_to_backward_prefetch": 2},
    "noreshard": {"reshard_after_forward": False},
    "nocast": {"cast_forward_inputs": False},
    "nonreentrant": {"use_reentrant": False},
}

_STRATEGY_KWARGS: dict[str, dict[str, Any]] = {
    "before_fused": {"fused_optimizer_step": False},
}


def split(spec: str) -> tuple[str, str]:
    """``"mm_fsdp2@fwd1"`` -> ``("mm_fsdp2", "fwd1")``; unknown variants are an error."""
    name, _, variant = spec.partition("@")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} in {spec!r}; known: {', '.join(v for v in VARIANTS if v)}")
    if variant and name not in ("mm_fsdp2", "mm_module"):
        raise ValueError(f"variants apply to mm_fsdp2 and mm_module only, got {spec!r}")
    return name, variant


def config_overrides(variant: str) -> dict[str, Any]:
    return dict(_OVERRIDES.get(variant, {}))


def strategy_kwargs(variant: str) -> dict[str, Any]:
    """Constructor arguments of ``MMFSDP2Strategy`` that the variant changes."""
    return dict(_STRATEGY_KWARGS.get(variant, {}))


@contextmanager
def behaviour(variant: str) -> Generator[None, None, None]:
    """Restore a pre-tuning behaviour of the strategy or module for the duration of one run."""
    if variant == "before_keep":
        owner, attr, replacement = ShardedRun, "keep_unsharded_for_backward", False
    elif variant == "before_lazylog":
        owner, attr = MMLightningModule, "_writes_step_logs"
        replacement = lambda self: True  # noqa: E731
    else:
        yield
        return
    original = getattr(owner, attr)
    setattr(owner, attr, replacement)
    try:
        yield
    finally:
        setattr(owner, attr, original)
