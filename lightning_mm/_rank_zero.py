"""Messages given once per job (by global rank 0) without importing Lightning: for the layers below it."""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist

__all__ = ["is_rank_zero", "rank_zero_info", "rank_zero_warn"]

log = logging.getLogger("lightning_mm")
log.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():  # as Lightning does for its own logger: INFO shows unless the app logs
    log.addHandler(logging.StreamHandler())
    log.propagate = False


def is_rank_zero() -> bool:
    """True outside a process group, and on its global rank 0."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> None:
    """``warnings.warn`` on global rank 0 only (the caller's caller is named as the place)."""
    if is_rank_zero():
        warnings.warn(message, category, stacklevel=stacklevel)


def rank_zero_info(message: str) -> None:
    """An INFO record of the ``lightning_mm`` logger, on global rank 0 only."""
    if is_rank_zero():
        log.info(message)
