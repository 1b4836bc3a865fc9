"""Weights a model built on the meta device still has to receive once it is sharded, kept by lightning-mm.

``TransformersModel`` and ``DiffusersModel`` built under :class:`~lightning_mm.MMFSDP2Strategy`'s meta-device context
defer reading their pretrained weights (a :class:`~lightning_mm.hf.transformers_model.PendingPretrained`), and
:func:`~lightning_mm.hf.lora.apply_lora` on such a model defers its adapters' values (a
:class:`~lightning_mm.hf.lora.PendingLoRA`), until ``FSDP2Mixin.load_after_sharding`` runs. That state is recorded
here, in tables keyed weakly by the model, never as attributes written on the user's model: a model that is
collected leaves its entries with it, and nothing foreign appears in the model's ``__dict__``, its ``state_dict`` or
its ``repr``.

* ``pending_pretrained(model)`` / ``set_pending_pretrained(model, pending)``: the deferred pretrained load (``None``
  once loaded). ``WeightInitMixin.init_weights`` zero-fills instead of drawing random values while one is pending.
* ``pending_lora(model)`` / ``set_pending_lora(model, pending)``: the deferred adapter values.

Setting ``None`` clears an entry. The entries' classes are not imported here (this module sits below both).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["pending_pretrained", "set_pending_pretrained", "pending_lora", "set_pending_lora"]

_PRETRAINED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_LORA: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _put(table: weakref.WeakKeyDictionary[nn.Module, Any], model: nn.Module, value: Any) -> None:
    if value is None:
        table.pop(model, None)
    else:
        table[model] = value


def pending_pretrained(model: Any) -> Any:
    """The pretrained weights ``model`` reads after sharding, or ``None`` (none deferred, or already loaded)."""
    return _PRETRAINED.get(model) if isinstance(model, nn.Module) else None


def set_pending_pretrained(model: nn.Module, pending: Any) -> None:
    """Record (or, with ``None``, clear) the pretrained weights ``model`` reads after sharding."""
    _put(_PRETRAINED, model, pending)


def pending_lora(model: Any) -> Any:
    """The LoRA adapter values written into ``model`` after sharding, or ``None``."""
    return _LORA.get(model) if isinstance(model, nn.Module) else None


def set_pending_lora(model: nn.Module, pending: Any) -> None:
    """Record (or, with ``None``, clear) the LoRA adapter values written into ``model`` after sharding."""
    _put(_LORA, model, pending)
