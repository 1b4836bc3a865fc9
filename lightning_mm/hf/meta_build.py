"""Build a Transformers model without allocating a parameter: Transformers' own meta-device path.

``from_pretrained`` builds every model under ``torch.device("meta")`` and then computes the buffers it needs (rotary
tables, position ids) with the model's own ``_init_weights`` rules (``initialize_weights()``). :func:`build_on_meta`
does the same for ``model_cls(config)``: parameters stay on the meta device (no storage, whatever their size), and
buffers are made real on the CPU and filled by the model's init, with the parameters marked initialised so that
nothing else is touched. The result is what building under :func:`lightning_mm.core.init_context.meta_parameters`
gives (meta parameters, real buffers), without the parameters' allocations: a 2,000,000 x 65,536 embedding costs
nothing.

A buffer the model's init rules do not compute (a constructor-only value) cannot be recovered this way, and a
constructor that needs real values (``.item()`` of a drop-path schedule) fails on the meta device: the model is then
built again under ``meta_parameters()`` (whose allocations are bounded: see there), and the debug log says why.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from lightning_mm._compat import HF_INIT_FLAG, clear_hf_init_flags
from lightning_mm.core.module_state import move_buffer

__all__ = ["build_on_meta", "unfilled_meta_buffers"]

log = logging.getLogger(__name__)


def _sentinel(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(math.nan)
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _unfilled(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return False
    if t.dtype == torch.bool:
        return True  # no value marks a bool tensor as unfilled: only a model's init that is known to fill it
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).min).all())


def unfilled_meta_buffers(model: nn.Module) -> list[str]:
    """Give every meta-device buffer of ``model`` real CPU storage and compute it with the model's own init rules
    (Transformers' ``initialize_weights()``, parameters left alone); returns the names of those it did not fill."""
    owners = [
        (prefix, module, name, buf)
        for prefix, module in model.named_modules()
        for name, buf in module.named_buffers(recurse=False)
        if buf is not None and buf.is_meta
    ]
    if not owners:
        return []
    for _, module, name, buf in owners:
        real = torch.empty_like(buf, device="cpu")
        _sentinel(real)
        move_buffer(module, name, real)  # same buffer: its persistence is kept
    clear_hf_init_flags(model)  # the construction's marks: every module is visited again
    params = list(model.parameters())
    for param in params:
        setattr(param, HF_INIT_FLAG, True)  # Transformers' init functions skip marked tensors
    try:
        with torch.no_grad():
            model.initialize_weights()  # type: ignore[operator]  # a Transformers PreTrainedModel
    finally:
        clear_hf_init_flags(model)
        for param in params:
            if getattr(param, HF_INIT_FLAG, False):
                delattr(param, HF_INIT_FLAG)
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, module, name, _ in owners
        if _unfilled(module.get_buffer(name))
    ]


def build_on_meta(model_cls: Any, config: Any) -> nn.Module:
    """``model_cls(config)`` with meta-device parameters and real buffers, no parameter ever allocated (see the
    module docstring)."""
    try:
        with torch.device("meta"):
            model = model_cls(config)
        unfilled = unfilled_meta_buffers(model)
        why = f"buffers {unfilled} are computed only by its constructor"
    except Exception as err:  # a constructor that needs real values (``.item()`` of a drop-path schedule)
        unfilled, why = ["?"], f"its constructor needs real tensors ({type(err).__name__}: {err})"
    if not unfilled:
        return model
    log.debug("%s: %s; building it with meta_parameters() instead", model_cls.__name__, why)
    from lightning_mm.core.init_context import meta_parameters

    with meta_parameters():
        return model_cls(config)
