"""Initialise a model materialised from the meta device the way its constructors would have.

A constructor builds its children first and then initialises its own parameters, and may change its children's
in doing so (``nn.MultiheadAttention`` zeroes ``out_proj.bias``; ``nn.Transformer`` redraws every matrix). So
modules are initialised children first, each with the method its constructor calls:

* torch's own modules: ``_reset_parameters()`` where torch defines one (``nn.MultiheadAttention``,
  ``nn.Transformer``), else ``reset_parameters()`` if the module holds parameters itself (a container such as
  ``nn.AdaptiveLogSoftmaxWithLoss`` leaves its children to initialise themselves, as its constructor does);
* ``nn.TransformerEncoder``/``nn.TransformerDecoder`` build their layers as copies of one layer, so the layers
  start equal: the first layer is initialised and copied into the others (when they are laid out alike);
* any other module: its ``reset_parameters()``, if it has one.

An embedding's padding row is zeroed on whichever rank holds it. Run in one process from the same seed, this
gives exactly the numbers of the eager constructors; sharded, the same constants and distributions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mm._compat import local_offsets, reset_torch_layer
from lightning_mm._utils.distributed import local_tensor

__all__ = ["init_like_constructors", "init_module_like_constructor", "zero_row"]

_CLONED_LAYERS = (nn.TransformerEncoder, nn.TransformerDecoder)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def zero_row(weight: torch.Tensor, row: int) -> None:
    """Zero ``weight[row]`` in place, on whichever rank holds that row when ``weight`` is sharded on dim 0."""
    row = row % weight.shape[0]
    if not isinstance(weight, DTensor):
        weight.data[row].zero_()
        return
    offsets, sizes = local_offsets(weight)  # this rank's region of the global tensor
    start, size = offsets[0], sizes[0]
    if start <= row < start + size:
        weight.to_local()[row - start].zero_()


def _is_torch_method(module: nn.Module, name: str) -> bool:
    method = getattr(type(module), name, None)
    return callable(method) and getattr(method, "__module__", "").startswith("torch.nn.")


@torch.no_grad()
def init_module_like_constructor(module: nn.Module) -> None:
    """Initialise the parameters ``module``'s own constructor initialises (its children are not touched, except
    where the constructor itself changes them)."""
    if isinstance(module, _EMBEDDINGS) and _is_torch_method(module, "reset_parameters"):
        nn.init.normal_(module.weight)
        if module.padding_idx is not None:
            zero_row(module.weight, module.padding_idx)
    elif _is_torch_method(module, "_reset_parameters"):
        reset_torch_layer(module)
    elif _is_torch_method(module, "reset_parameters"):
        if next(module.parameters(recurse=False), None) is not None:
            # nn.Module's stub types unknown attributes as tensors or modules; this one is a torch method
            cast("Callable[[], None]", module.reset_parameters)()
    else:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if isinstance(a, DTensor) and isinstance(b, DTensor):  # both or neither (checked above)
        return a.device_mesh == b.device_mesh and a.placements == b.placements
    return True


def _copy_first_layer(layers: nn.ModuleList) -> bool:
    """Copy ``layers[0]``'s tensors into the other layers, as the constructor's ``deepcopy`` does; ``False`` (and
    nothing copied) when the layers are laid out differently (sharded in one, whole in another)."""
    first = list(layers[0].parameters())
    others = [list(layer.parameters()) for layer in layers[1:]]
    if not all(len(o) == len(first) and all(_same_layout(a, b) for a, b in zip(first, o)) for o in others):
        return False
    for params in others:
        for src, dst in zip(first, params):
            local_tensor(dst).copy_(local_tensor(src))
    return True


@torch.no_grad()
def init_like_constructors(model: nn.Module) -> None:
    """Initialise every module of ``model``, children before parents, as its constructor does."""
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:  # a module used twice is initialised once
            return
        seen.add(id(module))
        if isinstance(module, _CLONED_LAYERS) and len(module.layers) > 1:
            visit(module.layers[0])
            if not _copy_first_layer(module.layers):
                for layer in module.layers[1:]:  # laid out differently: each drawn alike, on its own
                    visit(layer)
            for name, child in module.named_children():
                if name != "layers":
                    visit(child)
        else:
            for child in module.children():
                visit(child)
        init_module_like_constructor(module)

    visit(model)
