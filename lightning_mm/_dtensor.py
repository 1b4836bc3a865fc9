"""A tensor's local part, whether it is a ``DTensor`` (sharded) or a plain tensor.

A leaf module: it imports nothing from ``lightning_mm``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: ``to_local()`` of a ``DTensor``, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
