"""Build models without allocating their parameters: parameters go to the meta device, buffers stay real.

Buffers such as rotary-embedding tables are computed by the model's constructor and cannot be recomputed
generically, so only *parameters* are moved to the meta device as they are registered (through torch's public
parameter-registration hook, active only inside the context). The strategy later shards the parameters and
materialises just the local shards.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

__all__ = ["meta_parameters"]


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or param.is_meta:
        return None  # keep as registered (a tied parameter is registered again as the same object)
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


@contextmanager
def meta_parameters() -> Generator[None, None, None]:
    """Inside this context every newly registered parameter is replaced by a meta-device parameter."""
    # torch's annotation says the hook returns None; its docstring and register_parameter take a returned
    # parameter as the replacement, which is what _to_meta relies on.
    handle = register_module_parameter_registration_hook(_to_meta)  # type: ignore[arg-type]
    try:
        yield
    finally:
        handle.remove()
