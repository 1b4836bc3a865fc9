"""Build models without allocating their parameters: parameters go to the meta device, buffers stay real.

Buffers such as rotary-embedding tables are computed by the model's constructor and cannot be recomputed
generically, so only *parameters* are moved to the meta device as they are registered (through torch's public
parameter-registration hook, active only inside the context). The strategy later shards the parameters and
materialises just the local shards.

A parameter is created before it is registered (``nn.Parameter(torch.empty(rows, cols))``), so inside the context a
tensor-creating call (``torch.empty``, ``zeros``, ``ones``, ``full``, ``rand``, ``randn``...) whose result would
exceed :data:`LARGE_TENSOR_BYTES` is made on the meta device from the start: building a model of any size holds at
most one such tensor of real memory at a time. A buffer that large is then on the meta device too and is filled when
the model is materialised (its ``init_weights()`` / ``reset_parameters()``), or the materialisation names it.
Transformers models built by ``TransformersModel`` allocate nothing at all (:mod:`lightning_mm.hf.meta_build`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

__all__ = ["LARGE_TENSOR_BYTES", "meta_parameters"]

LARGE_TENSOR_BYTES = 256 * 2**20
"""Inside :func:`meta_parameters`, tensors created larger than this (bytes) are created on the meta device."""

_FACTORIES: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.empty,
        torch.empty_strided,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.eye,
    }
)


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or param.is_meta:
        return None  # keep as registered (a tied parameter is registered again as the same object)
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


class _LargeTensorsOnMeta(TorchFunctionMode):
    """Tensor factories whose result exceeds :data:`LARGE_TENSOR_BYTES` create it on the meta device."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("out") is None:
            meta = {**kwargs, "device": "meta"}
            if meta.get("generator") is not None:
                meta["generator"] = None  # the meta device draws nothing: a CPU generator is neither used nor advanced
            try:
                probe = func(*args, **meta)
            except (TypeError, RuntimeError, ValueError):  # arguments the meta device cannot take: as asked
                probe = None
            if isinstance(probe, torch.Tensor) and probe.numel() * probe.element_size() > LARGE_TENSOR_BYTES:
                return probe
        return func(*args, **kwargs)


@contextmanager
def meta_parameters() -> Generator[None, None, None]:
    """Inside this context every newly registered parameter is replaced by a meta-device parameter, and tensors
    created larger than :data:`LARGE_TENSOR_BYTES` are created on the meta device (see the module docstring)."""
    # torch's annotation says the hook returns None; its docstring and register_parameter take a returned
    # parameter as the replacement, which is what _to_meta relies on.
    handle = register_module_parameter_registration_hook(_to_meta)  # type: ignore[arg-type]
    try:
        with _LargeTensorsOnMeta():
            yield
    finally:
        handle.remove()
