"""MindSpeed MM's module-path patterns: ``layers.{*}``, ``layers.{0-23}``, ``layers.{1,3,5}``, ``layers.{0-3,7}``.

A pattern is a dotted path whose segments are either a literal child name or a brace group covering the whole
segment. Resolving a pattern against a module tree follows MindSpeed MM (a ``{*}`` followed by a name keeps the
branches that have it), and is stricter where a silent miss would leave a model unsharded: a pattern that names no
module at all is an error that shows the closest existing paths.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from torch import nn

from lightning_mm._utils.modules import is_under
from lightning_mm._utils.suggestions import nearest
from lightning_mm.errors import ConfigError

__all__ = [
    "PatternError",
    "Segment",
    "parse_pattern",
    "resolve_pattern",
    "resolve_patterns",
    "names_or_contains",
    "names_inside",
]


class PatternError(ConfigError):
    """A module-path pattern that is malformed or resolves to nothing."""


@dataclass(frozen=True)
class Segment:
    """One path segment: a literal name, every child (``{*}``) or child index ranges.

    Ranges are kept as ``(start, stop)`` pairs (inclusive), never expanded: ``{0-999999999}`` costs two integers
    here, and resolving it against a model checks it against the children the model has.
    """

    name: str | None = None
    ranges: tuple[tuple[int, int], ...] | None = None  # None with name None means "every child"

    @property
    def is_wildcard(self) -> bool:
        return self.name is None and self.ranges is None


_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_MAX_DIGITS = 18
_SHOWN = 80


def short(pattern: str) -> str:
    """A pattern as error messages show it: cut after a few dozen characters."""
    return pattern if len(pattern) <= _SHOWN else pattern[:_SHOWN] + "..."


def _parse_braces(body: str, pattern: str) -> Segment:
    if body.strip() == "*":
        return Segment()
    ranges: list[tuple[int, int]] = []
    for item in body.split(","):
        match = _ITEM.match(item)
        if not match:
            raise PatternError(
                f"malformed brace group '{{{short(body)}}}' in pattern '{short(pattern)}': expected '*', integers, "
                f"or ranges such as '{{0-23}}' or '{{1,3,5}}'"
            )
        if any(g is not None and len(g) > _MAX_DIGITS for g in match.groups()):
            raise PatternError(f"index with more than {_MAX_DIGITS} digits in pattern '{short(pattern)}'")
        start = int(match.group(1))
        stop = int(match.group(2)) if match.group(2) is not None else start
        if stop < start:
            raise PatternError(f"descending range '{item.strip()}' in pattern '{short(pattern)}'")
        ranges.append((start, stop))
    return Segment(ranges=tuple(ranges))


def parse_pattern(pattern: str) -> tuple[Segment, ...]:
    """Split a pattern into segments, rejecting malformed braces and empty segments.

    Each distinct pattern is parsed once: the config's validation parses it (a malformed pattern fails when the
    YAML is loaded) and every later resolution reuses that parse (the segments are immutable).
    """
    if not isinstance(pattern, str) or not pattern.strip():
        raise PatternError(f"empty module path pattern: {short(repr(pattern))}")
    return _parse(pattern)


@functools.lru_cache(maxsize=4096)
def _parse(pattern: str) -> tuple[Segment, ...]:
    segments = []
    for raw in pattern.strip().split("."):
        if raw.startswith("{") and raw.endswith("}") and raw.count("{") == 1 and raw.count("}") == 1:
            segments.append(_parse_braces(raw[1:-1], pattern))
        elif "{" in raw or "}" in raw:
            raise PatternError(
                f"malformed braces in pattern '{short(pattern)}': a brace group must be a whole path segment, "
                f"as in 'layers.{{0-3}}'"
            )
        elif not raw:
            raise PatternError(f"empty path segment in pattern '{short(pattern)}'")
        else:
            segments.append(Segment(name=raw))
    return tuple(segments)


def _closest(root: nn.Module, wanted: str, n: int = 3) -> str:
    names = [name for name, _ in root.named_modules() if name]
    close = nearest(wanted, names, n=n, cutoff=0.5)
    if not close:
        # Fall back to the children of the deepest existing prefix.
        prefix = wanted
        while prefix and prefix not in names:
            prefix = prefix.rpartition(".")[0]
        depth = prefix.count(".") + 1 if prefix else 0
        close = [m for m in names if is_under(m, prefix) and m.count(".") == depth][:n]
    return ", ".join(f"'{c}'" for c in close) if close else "(the model has no submodules)"


def _wanted(segment: Segment, children: dict[str, nn.Module]) -> list[str]:
    """The child names a literal or index segment asks for, in pattern order without repeats.

    A range is never enumerated past the children that exist: its first missing index is returned as the last
    name, so the caller's "no module at ..." error names it. The work is bounded by the number of children.
    """
    if segment.name is not None:
        return [segment.name]
    out: dict[str, None] = {}
    for start, stop in segment.ranges or ():
        index = start
        while index <= stop:
            name = str(index)
            out[name] = None
            if name not in children:
                return list(out)
            index += 1
    return list(out)


def resolve_pattern(root: nn.Module, pattern: str) -> list[str]:
    """All module paths under ``root`` that ``pattern`` names, in module order.

    As in MindSpeed MM, which matches each pattern against ``named_modules()``, a ``{*}`` (or index range) followed
    by a name keeps the branches that have that name: ``layers.{*}.linear_attn`` names the ``linear_attn`` of the
    layers that have one (Qwen3.5 mixes gated-delta-net and full-attention layers). Stricter than MindSpeed MM,
    which only warns: a pattern that names no module at all, or an index range past the children that exist, is an
    error showing the closest existing paths.
    """
    frontier: list[tuple[str, nn.Module]] = [("", root)]
    first_miss: str | None = None
    for segment in parse_pattern(pattern):
        nxt: list[tuple[str, nn.Module]] = []
        for prefix, module in frontier:
            children = dict(module.named_children())

            def join(name: str, p: str = prefix) -> str:
                return f"{p}.{name}" if p else name

            if segment.is_wildcard:
                if children:
                    nxt.extend((join(name), child) for name, child in children.items())
                elif first_miss is None:
                    first_miss = (
                        f"pattern '{short(pattern)}': '{prefix or '<model>'}' has no submodules for '{{*}}' to match; "
                        f"closest paths: {_closest(root, prefix)}"
                    )
                continue
            for name in _wanted(segment, children):
                if name in children:
                    nxt.append((join(name), children[name]))
                    continue
                message = (
                    f"pattern '{short(pattern)}' resolves to no module at '{join(name)}'; "
                    f"closest existing paths: {_closest(root, join(name))}"
                )
                if segment.ranges is not None:  # an index past the children that exist: never a partial match
                    raise PatternError(message)
                first_miss = first_miss or message
        frontier = nxt
        if not frontier:
            raise PatternError(first_miss or f"pattern '{short(pattern)}' names no module")
    return [path for path, _ in frontier]


def resolve_patterns(root: nn.Module, patterns: list[str], key: str = "patterns") -> list[str]:
    """Resolve several patterns, keeping first-seen order and dropping duplicates; errors name ``key``."""
    out: dict[str, None] = {}
    for pattern in patterns:
        try:
            for path in resolve_pattern(root, pattern):
                out[path] = None
        except PatternError as err:
            raise PatternError(f"`{key}`: {err}") from None
    return list(out)


def _segment_names(segment: Segment, name: str) -> bool:
    """Whether one path segment ``name`` is what ``segment`` asks for (as :func:`resolve_pattern` would take it)."""
    if segment.is_wildcard:
        return True
    if segment.name is not None:
        return segment.name == name
    if not name.isdigit() or name != str(int(name)):  # resolution names items "3", never "03"
        return False
    index = int(name)
    return any(start <= index <= stop for start, stop in segment.ranges or ())


def _matching_prefix(pattern: str, path: str) -> tuple[int, int] | None:
    """(segments of ``pattern``, segments of ``path``) when the shorter one's segments all match, else ``None``."""
    try:
        segments = parse_pattern(pattern)
    except PatternError:
        return None  # the plan reports a malformed pattern, with the key it came from
    names = path.split(".") if path else []
    if all(_segment_names(segment, name) for segment, name in zip(segments, names)):
        return len(segments), len(names)
    return None


def names_or_contains(pattern: str, path: str) -> bool:
    """Whether module ``path`` is one that ``pattern`` names, or lies inside one, read from the two strings alone.

    For the modules a model has, the same as ``is_under_any(path, resolve_pattern(model, pattern))`` when the
    pattern resolves, without walking the model again: a caller that only filters paths by the user's patterns
    (the default plan of a Hugging Face model) leaves their one strict resolution, and its errors, to the plan.
    """
    lengths = _matching_prefix(pattern, path)
    return lengths is not None and lengths[1] >= lengths[0]


def names_inside(pattern: str, path: str) -> bool:
    """Whether ``pattern`` names module ``path`` itself or modules inside it (read from the two strings alone)."""
    lengths = _matching_prefix(pattern, path)
    return lengths is not None and lengths[0] >= lengths[1]
