"""The one key reader of MindSpeed MM's files: types, ranges and unknown keys, errors naming file and key path.

Every reader of a MindSpeed MM file (the flag table, the single YAML's ``lora_args``, the native route's sections,
the model.json and the data configs) checks its values here, so that a value of the wrong type or out of its range
is refused the same way everywhere: one line naming the file and the key (``data.yaml: `dataset_param.x`: expected
an integer >= 1, got 0``), before any work starts. MindSpeed MM's dataclasses parse numbers written as strings
(``lr: 1e-5`` in YAML is a string), so numbers may be strings here too; a boolean is never a number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_mm._utils.suggestions import find_unknown_key
from lightning_mm._utils.yaml_io import short_repr
from lightning_mm.errors import LightningMMError

__all__ = ["MindSpeedConfigError", "KeyReader", "expected_number", "read_number", "shown_bound"]


class MindSpeedConfigError(LightningMMError, ValueError):
    """A MindSpeed MM file (launch script, YAML, model.json, data config) that cannot be read or translated; the
    message names the file and the key path (or the flag, or the script's line)."""


def shown_bound(bound: float) -> str:
    """A range bound as a message shows it: ``4294967295``, ``0.5``."""
    return str(int(bound)) if bound == int(bound) else f"{bound:g}"


def expected_number(
    integer: bool,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> str:
    """What a number must be, as a message says it: ``an integer >= 1``, ``a number > 0 and <= 1``."""
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {shown_bound(low)}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {shown_bound(high)}")
    want = "an integer" if integer else "a number"
    return f"{want} {' and '.join(bounds)}" if bounds else want


def read_number(
    value: Any,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float | int | None:
    """``value`` as a finite number in its range (an ``int`` when ``integer``), else None. Strings that parse as
    numbers are numbers (MindSpeed MM's dataclasses and Megatron's argparse read them so); booleans are not."""
    if isinstance(value, bool):
        return None
    try:
        number: float | int = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number):
        return None
    if integer:
        if number != int(number):
            return None
        number = int(number)
    if low is not None and (number <= low if low_open else number < low):
        return None
    if high is not None and (number >= high if high_open else number > high):
        return None
    return number


@dataclass
class KeyReader:
    """Reads the keys of one file (``source``) below ``prefix``; every error is ``error`` with the message
    ``template.format(source=..., in_source=" in <source>" or "", key=<prefix + key>)`` + ``: <what is wrong>``."""

    source: str | None
    prefix: str = ""
    error: type[Exception] = MindSpeedConfigError
    template: str = "{source}: `{key}`"

    def where(self, key: str) -> str:
        in_source = f" in {self.source}" if self.source else ""
        return self.template.format(source=self.source, in_source=in_source, key=f"{self.prefix}{key}")

    def fail(self, key: str, message: str) -> Exception:
        """The error for ``key`` (below the prefix): raise what this returns."""
        return self.error(f"{self.where(key)}: {message}")

    def below(self, key: str) -> KeyReader:
        """The reader of the section at ``key``."""
        return KeyReader(self.source, f"{self.prefix}{key}." if key else self.prefix, self.error, self.template)

    def number(
        self,
        value: Any,
        key: str,
        integer: bool = False,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        high_open: bool = False,
    ) -> Any:
        """``value`` (at ``key``) checked against its type and range; ``None`` stays None (not set)."""
        if value is None:
            return None
        number = read_number(value, integer, low, high, low_open, high_open)
        if number is None:
            want = expected_number(integer, low, high, low_open, high_open)
            raise self.fail(key, f"expected {want}, got {value!r}")
        return number

    def int_at_least(self, value: Any, key: str, low: int = 1) -> int:
        """An integer written as one (not a string, not a boolean), at least ``low``."""
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.fail(key, f"expected an integer >= {low}, got {short_repr(value)}")
        return value

    def flag(self, value: Any, key: str, default: bool | None = None) -> bool:
        """``true`` or ``false``; ``None`` (absent or empty) is ``default`` when one is given."""
        if value is None and default is not None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {short_repr(value)}")
        return value

    def mapping(self, value: Any, key: str) -> Mapping[str, Any]:
        """A section: a mapping of keys to values."""
        if not isinstance(value, Mapping):
            raise self.fail(key, f"expected a mapping, got {short_repr(value)}")
        return value

    def unknown(self, names: Iterable[Any], known: Iterable[str]) -> tuple[str, str] | None:
        """The first of ``names`` not in ``known`` (shown with the prefix) and a did-you-mean hint, or None."""
        return find_unknown_key(list(names), list(known), self.prefix)
