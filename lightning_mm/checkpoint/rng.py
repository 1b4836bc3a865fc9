"""RNG states of one rank: captured at save, restored on resume (all in weights-only-loadable types)."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def _device_module(device: torch.device | None) -> Any:
    if device is None or device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if module is not None and hasattr(module, "get_rng_state") else None


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """Python, torch (CPU and the accelerator of ``device``) and, if imported, NumPy global RNG states."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    module = _device_module(device)
    if module is not None:
        state["device"] = {"type": device.type, "state": module.get_rng_state(device)}  # type: ignore[union-attr]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, gauss = numpy.random.get_state(legacy=True)
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    return state


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`capture_rng` captured."""
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    saved = state.get("device")
    module = _device_module(device)
    if saved is not None and module is not None and saved["type"] == device.type:  # type: ignore[union-attr]
        module.set_rng_state(saved["state"], device)
    if "numpy" in state:
        import numpy

        np_state = state["numpy"]
        numpy.random.set_state(
            (
                np_state["name"],
                np_state["keys"].numpy().astype("uint32"),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["gauss"],
            )
        )


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` needs tuples; a serialisation round trip may have turned them into lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value
