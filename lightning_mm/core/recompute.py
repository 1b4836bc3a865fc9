"""Activation recomputation that gives the gradients of the plain model, with either ``use_reentrant`` value.

Recomputation runs a module's forward a second time in backward. That replay must be free of side effects, and
every tensor the module reads must reach the checkpoint as an input:

* A key/value cache (Transformers' ``Cache``, created by the model when ``use_cache`` is on, which is the
  default even in training) is appended to by each attention layer: the replay would append the same keys and
  values a second time and the layer would attend to them twice, so ``k_proj``/``v_proj`` get zero gradients and
  earlier layers wrong ones. In a call that is checkpointed, a recomputed module gets ``use_cache=False`` and no
  cache (each keyword argument holding a cache becomes ``None``), exactly as Transformers' own gradient
  checkpointing does. Training needs no cache; inference (no gradients) is never checkpointed and keeps it.
* Running statistics (BatchNorm and the other norms with ``track_running_stats``) are updated in forward: a
  replay would update them twice. Such a module cannot be recomputed; :func:`check_recomputable` says so before
  any work starts.
* The reentrant implementation passes only positional arguments through autograd: a tensor handed over as a
  keyword argument would be a constant of the replay, and the replay's backward would run on into the graph
  that produced it, which the outer backward then reaches a second time (an error, or gradients counted twice).
  Tensor keyword arguments (and tuples or lists of tensors) are therefore passed positionally and put back in
  place inside the checkpoint.
  When no input needs a gradient (frozen embeddings before recomputed layers) the reentrant implementation would
  give the module's own parameters none; a zero-size input that requires a gradient is added then. And it
  passes gradients only to tensors returned directly: the tensors of a structured output (a tuple of tuples, a
  dict, Transformers' ``ModelOutput``) are returned flat and the structure is rebuilt around them.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mm.errors import ConfigError

__all__ = ["checkpointed_forward", "check_recomputable", "is_recomputed", "RecomputeError", "uses_kv_cache"]

log = logging.getLogger(__name__)

_MARK = "__lightning_mm_recompute__"


class RecomputeError(ConfigError):
    """A module that cannot be recomputed exactly."""


def _cache_types() -> tuple[type, ...]:
    """Transformers' key/value cache class, if Transformers is in use (it is never imported here)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache = getattr(cache_utils, "Cache", None)
    return (cache,) if isinstance(cache, type) else ()


def uses_kv_cache(model: nn.Module) -> bool:
    """Whether some Transformers config in ``model`` turns the key/value cache on by default (``use_cache``)."""
    return any(getattr(getattr(m, "config", None), "use_cache", False) is True for m in model.modules())


def _stateful_norms(module: nn.Module) -> list[str]:
    """Submodules that update running statistics in a training forward (torch's batch/instance norms and any module
    following their ``track_running_stats`` + ``running_mean`` convention)."""
    return [
        name or "<itself>"
        for name, sub in module.named_modules()
        if getattr(sub, "track_running_stats", False) is True and getattr(sub, "running_mean", None) is not None
    ]


def check_recomputable(model: nn.Module, paths: Iterable[str], source: str | None = None) -> None:
    """Raise :class:`RecomputeError` for a ``recompute_modules`` entry whose forward changes state that a replay
    would change again (running statistics of norms)."""
    where = f" in {source}" if source else ""
    for path in paths:
        norms = _stateful_norms(model.get_submodule(path))
        if norms:
            raise RecomputeError(
                f"FSDP2 config key `recompute_modules`{where}: '{path}' cannot be recomputed: "
                f"{', '.join(norms[:4])}{' ...' if len(norms) > 4 else ''} update running statistics in forward, "
                "and the replay in backward would update them a second time. Recompute modules without such "
                "norms, or build those norms with track_running_stats=False"
            )


def _without_cache(name: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    caches = _cache_types()
    if caches:
        for i, arg in enumerate(args):
            if isinstance(arg, caches):
                raise RecomputeError(
                    f"recomputed module '{name}' got a key/value cache as positional argument {i}: its replay in "
                    "backward would update the cache a second time. Pass it by keyword (it is then dropped while "
                    "recomputing) or call the model with use_cache=False in training"
                )
    dropped = [k for k, v in kwargs.items() if caches and isinstance(v, caches)]
    if not dropped and not kwargs.get("use_cache"):
        return kwargs
    kwargs = dict(kwargs)
    for key in dropped:
        kwargs[key] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return kwargs


def _is_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


def _reentrant(forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """``checkpoint(use_reentrant=True)`` with tensor keyword arguments routed through autograd as inputs."""
    tensor_keys = [k for k, v in kwargs.items() if _is_tensors(v)]
    constants = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    flat: list[Any] = list(args)
    layout: list[tuple[str, type | None, int]] = []  # key, container type (None: a tensor), count
    for key in tensor_keys:
        value = kwargs[key]
        if isinstance(value, torch.Tensor):
            flat.append(value)
            layout.append((key, None, 1))
        else:
            flat.extend(value)
            layout.append((key, type(value), len(value)))
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat) and _has_trainable(forward):
        # Otherwise the checkpoint's output needs no gradient and the module's parameters would get none.
        device = next((t.device for t in flat if isinstance(t, torch.Tensor)), None)
        flat.append(torch.empty(0, device=device, requires_grad=True))
    n_args = len(args)
    first_output: list[Any] = []

    def run(*inputs: Any) -> tuple[torch.Tensor, ...]:
        rebuilt = dict(constants)
        offset = n_args
        for key, container, count in layout:
            part = inputs[offset : offset + count]
            rebuilt[key] = part[0] if container is None else container(part)
            offset += count
        output = forward(*inputs[:n_args], **rebuilt)
        if not first_output:  # the replay in backward returns the same structure
            first_output.append(output)
        # Only tensors returned directly (in a tuple) get gradients through the reentrant checkpoint.
        return tuple(_tensors_in(output))

    tensors = checkpoint(run, *flat, use_reentrant=True)
    return _with_tensors(first_output.pop(), iter(tensors))


def _has_trainable(forward: Callable[..., Any]) -> bool:
    owner = getattr(forward, "__self__", None)
    return not isinstance(owner, nn.Module) or any(p.requires_grad for p in owner.parameters())


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's output: a tensor, or tuples, lists and mappings (Transformers' ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def _with_tensors(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``value`` with its tensors (in :func:`_tensors_in` order) replaced by the next ones of ``tensors``."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (tuple, list)):
        items = [_with_tensors(v, tensors) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, Mapping):
        return type(value)(**{k: _with_tensors(v, tensors) for k, v in value.items()})
    return value


def checkpointed_forward(forward: Callable[..., Any], use_reentrant: bool, name: str) -> Callable[..., Any]:
    """``forward`` wrapped so that, when gradients are on, its activations are recomputed in backward."""
    logged = False

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal logged
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        clean = _without_cache(name, args, kwargs)
        if clean is not kwargs and not logged:
            logged = True
            log.info(
                "'%s' is recomputed: it runs without the key/value cache in training (a replay would "
                "update the cache twice)",
                name,
            )
        if use_reentrant:
            return _reentrant(forward, args, clean)
        return checkpoint(forward, *args, use_reentrant=False, **clean)

    setattr(run, _MARK, True)
    return run


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``module.forward`` is already wrapped by :func:`checkpointed_forward`."""
    return bool(getattr(module.forward, _MARK, False))
