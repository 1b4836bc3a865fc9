"""Leaving ``torch.inference_mode`` for work that DTensor parameters cannot do inside it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


@contextmanager
def leave_inference_mode() -> Iterator[None]:
    """Inside ``torch.inference_mode``: leave it for the block, under ``no_grad``; elsewhere: change nothing.

    Parameters created in inference mode are inference tensors that FSDP2 cannot shard, gather or step, and DTensor
    state dicts can be neither taken nor loaded there ("Cannot set version_counter for inference tensor").
    """
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def outside_inference_mode(fn: _F) -> _F:
    """Decorator form of :func:`leave_inference_mode`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with leave_inference_mode():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
