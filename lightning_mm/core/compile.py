"""Per-block ``torch.compile``: each ``compile_modules`` module's forward compiled as one graph.

Order with the rest of the plan (:func:`lightning_mm.core.apply.apply_plan`): the block's own forward is compiled
first, recomputation then wraps the compiled forward (so both ``use_reentrant`` values work and the replay in
backward reuses the compiled graph), and ``fully_shard`` comes last, so FSDP2's all-gather and reshard hooks run
eagerly around each compiled block. The root and every module outside ``compile_modules`` stay eager.

* One graph per block (``fullgraph=True``): an op or hook that torch.compile cannot capture is a
  :class:`CompileError` naming the module on its first call, never a silent eager run.
* Sequence lengths: shapes are left to torch.compile's automatic dynamic shapes (``dynamic=None``): the first call
  is compiled for its shapes, the first call with another length once more with that dimension dynamic, and every
  later length reuses that graph. Blocks of one class share their graphs (torch's default inlining of
  ``nn.Module`` calls), so a model with ``compile_modules: layers.{*}`` compiles two forward graphs in all,
  whatever the number of layers and lengths (four with reentrant recomputation, whose first pass runs without
  gradients).

Lightning-free and Transformers-free.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from lightning_mm._compat import DYNAMO_ERRORS
from lightning_mm.errors import ConfigError, LightningMMError

__all__ = ["CompileError", "compiled_forward", "is_compiled", "check_backend"]

_MARK = "__lightning_mm_compiled__"


class CompileError(LightningMMError, RuntimeError):
    """A ``compile_modules`` module whose forward torch.compile cannot capture as one graph."""


def check_backend(backend: str) -> None:
    """Raise ``ValueError`` unless ``backend`` is a registered torch.compile backend."""
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(f"unknown torch.compile backend {backend!r}; registered: {', '.join(sorted(known))}")


def is_compiled(forward: Callable[..., Any]) -> bool:
    return getattr(forward, _MARK, False) is True


def compiled_forward(forward: Callable[..., Any], backend: str, name: str) -> Callable[..., Any]:
    """``forward`` compiled by ``backend`` as one graph; capture failures name the module ``name``."""
    compiled = torch.compile(forward, backend=backend, fullgraph=True, dynamic=None)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except DYNAMO_ERRORS as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CompileError(
                f"FSDP2 config key `compile_modules`: '{name}' cannot be compiled as one graph by torch.compile "
                f"(backend {backend!r}): {first}. Remove it from `compile_modules` (it then runs eagerly) or "
                "compile modules inside it"
            ) from err

    setattr(run, _MARK, True)
    return run
