"""Names in error messages: the nearest valid names to a wrong one, and bounded listings of names.

One place for the "did you mean" suggestions of every config reader (FSDP2 YAML, data YAML, model-side configs,
Hugging Face config overrides, ``ModelHub`` keys, module path patterns), so that they pick suggestions by the same
rule. A leaf module: it imports nothing from ``lightning_mm``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = ["KEY_SHOWN", "nearest", "did_you_mean", "find_unknown_key", "listing"]

KEY_SHOWN = 80
"""At most this many characters of an unknown key are quoted back (a key can be a whole pasted document)."""


def nearest(word: object, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Up to ``n`` of ``candidates`` closest to ``word`` (``difflib``'s ratio at least ``cutoff``), closest first.

    ``word`` may be any object (a YAML key can be an integer): it is compared as its ``str``.
    """
    return difflib.get_close_matches(str(word), list(candidates), n=n, cutoff=cutoff)


def did_you_mean(word: object, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> str:
    """``"; did you mean 'a', 'b'?"`` naming the nearest ``candidates`` to ``word``, or ``""`` when none is near."""
    close = nearest(word, candidates, n=n, cutoff=cutoff)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def find_unknown_key(keys: Iterable[object], known: Sequence[str], prefix: str = "") -> tuple[str, str] | None:
    """The first of ``keys`` that is not in ``known`` (``None`` if every key is), as ``(shown, hint)``.

    ``shown`` is the key as messages quote it: ``prefix`` (the dotted section it sits in, e.g. ``"loader."``) and at
    most :data:`KEY_SHOWN` characters of it. ``hint`` is ``"; did you mean `prefix.nearest`?"``, or, when no valid
    key is near, ``"; valid keys: a, b, c"``. A key that is not a string is never valid.
    """
    for key in keys:
        if isinstance(key, str) and key in known:
            continue
        close = nearest(key, known, n=1)
        hint = f"; did you mean `{prefix}{close[0]}`?" if close else f"; valid keys: {', '.join(known)}"
        return f"{prefix}{str(key)[:KEY_SHOWN]}", hint
    return None


def listing(items: Sequence[object], limit: int, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` joined by ``sep``, then ``"... and N more"`` (after ``sep``) for the rest."""
    shown = [str(item) for item in items[:limit]]
    if len(items) > limit:
        shown.append(f"... and {len(items) - limit} more")
    return sep.join(shown)
