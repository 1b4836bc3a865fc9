"""Record providers: what other layers add to a training checkpoint's ``lightning_mm`` entry, through a hook.

A provider is registered under a name (``register_record_provider("hf", hf_records)``, done by the Hugging Face
integration when it is imported) and called with the LightningModule when a checkpoint is saved; what it returns
(JSON-able data) is stored under its name next to the checkpoint's own keys. The strategy asks for
:func:`collect_records` and names no provider. A provider may come with a check, which :func:`check_records` runs
when a checkpoint is loaded (before any tensor is read) with the checkpoint's records and the module it loads
into; it raises to refuse the load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lightning_mm.errors import ConfigError

__all__ = ["RecordProvider", "RecordCheck", "register_record_provider", "collect_records", "check_records"]

RecordProvider = Callable[[nn.Module], Any]
RecordCheck = Callable[[Mapping[str, Any], nn.Module, str], None]
"""``check(records, root, where)``: the loaded checkpoint's records (every name), the module, the checkpoint path."""

#: The checkpoint's own keys in the ``lightning_mm`` entry, which no provider may take.
RESERVED = frozenset(
    {
        "format_version",
        "format",
        "kind",
        "world_size",
        "mesh_shape",
        "rng_point",
        "ranks",
        "manifest",
        "optimizer_param_names",
    }
)

_providers: dict[str, RecordProvider] = {}
_checks: dict[str, RecordCheck] = {}


def register_record_provider(name: str, provider: RecordProvider, check: RecordCheck | None = None) -> None:
    """Record ``provider(root)`` under ``name`` in every training checkpoint saved from now on (idempotent for the
    same provider; another provider under a taken name is an error); ``check`` runs on every load."""
    if name in RESERVED:
        raise ConfigError(f"checkpoint record name {name!r} is one of the checkpoint's own keys ({sorted(RESERVED)})")
    known = _providers.get(name)
    if known is not None and known is not provider:
        raise ConfigError(f"a checkpoint record provider is already registered under {name!r} ({known!r})")
    _providers[name] = provider
    if check is not None:
        _checks[name] = check


def collect_records(root: nn.Module) -> dict[str, Any]:
    """Every registered provider's record of ``root``, by name."""
    return {name: provider(root) for name, provider in _providers.items()}


def check_records(records: Mapping[str, Any], root: nn.Module, where: str) -> None:
    """Run every registered check on a loaded checkpoint's ``records`` for ``root`` (raises to refuse the load)."""
    for check in _checks.values():
        check(records, root, where)
