"""``Trainer(devices=...)`` for an accelerator whose devices are numbered ``0..n-1`` (deciding only: no torch_npu).

Accepted forms, as Lightning accepts them for GPUs: an int ``n`` (the first ``n`` devices), ``-1`` (all), a list or
tuple of indices, and the strings ``"auto"``/``"-1"`` (all), ``"2"`` (the first two) and ``"0,1"`` / ``"1,"``
(those indices). :func:`npu_device` reads one device as a ``torch.device`` of type ``npu``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_mm.errors import ConfigError, InputTypeError

__all__ = ["parse_device_indices", "npu_device"]


def npu_device(device: torch.device | str | int, needed_by: str) -> torch.device:
    """``device`` (an index, ``"npu:1"``, a ``torch.device``) as an npu ``torch.device``; any other type of device
    is a ``ValueError`` saying that ``needed_by`` needs an npu device."""
    device = torch.device("npu", device) if isinstance(device, int) else torch.device(device)
    if device.type != "npu":
        raise ConfigError(f"{needed_by} needs an npu device, got {device}")
    return device


def parse_device_indices(
    devices: int | str | Sequence[int], available: int, name: str = "NPU", hint: str = ""
) -> list[int]:
    """The device indices ``devices`` asks for, checked against the ``available`` count.

    Raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a malformed value, an empty or
    duplicated selection, or indices that are not visible; ``hint`` is appended to the availability errors.
    """
    requested = _requested(devices, available, name)
    if not requested:
        raise ConfigError(f"`devices={devices!r}` selects no {name}; ask for at least one")
    if len(set(requested)) != len(requested):
        raise ConfigError(f"`devices={devices!r}` names the same {name} twice; each index must be unique")
    if any(i < 0 for i in requested):
        raise ConfigError(f"`devices={devices!r}`: {name} indices must be non-negative")
    missing = [i for i in requested if i >= available]
    if missing:
        suffix = f" {hint}" if hint else ""
        if not available:
            raise ConfigError(f"`devices={devices!r}` asks for {name}s but none is visible.{suffix}")
        raise ConfigError(
            f"`devices={devices!r}` asks for {name} {requested}, but only {available} {name}(s) are visible "
            f"(indices 0..{available - 1}; not visible: {missing}).{suffix}"
        )
    return requested


def _requested(devices: object, available: int, name: str) -> list[int]:
    if isinstance(devices, bool):
        raise InputTypeError(f"`devices` must be an int, a string or a sequence of ints, got the bool {devices!r}")
    if isinstance(devices, int):
        return _from_int(devices, available, name)
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            return list(range(available))
        try:
            if "," in text:
                return [int(piece) for piece in text.split(",") if piece.strip()]
            return _from_int(int(text), available, name)
        except ValueError:
            raise ConfigError(
                f"`devices={devices!r}` is not a count, an index list such as '0,1', 'auto' or '-1'"
            ) from None
    if isinstance(devices, Sequence):
        if not all(type(i) is int for i in devices):
            raise InputTypeError(f"`devices={devices!r}`: a sequence of devices must hold ints only")
        return list(devices)
    raise InputTypeError(f"`devices` must be an int, a string or a sequence of ints, got {type(devices).__name__}")


def _from_int(count: int, available: int, name: str) -> list[int]:
    if count == -1:
        return list(range(available))
    if count <= 0:
        raise ConfigError(f"`devices={count}` is not a valid number of {name}s: use a positive count or -1 for all")
    return list(range(count))
