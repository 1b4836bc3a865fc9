"""Reading a MindSpeed MM / Megatron launch script: shell lines, ``$VAR`` expansion, the ``torchrun`` line.

Scripts are read the way Megatron launch scripts are written: ``VAR=value`` / ``export`` lines, ``$VAR`` and
``${VAR}`` expansion, ``$((integer arithmetic))``, line continuations, quoted values over several lines, and a
``torchrun ... pretrain_xxx.py ...`` (or ``python ...``) line, cut at pipes and redirections. Nothing is run.

Everything is bounded: the text is read once (linear time, whatever the quoting), expansion stops at
:data:`MAX_EXPANDED_BYTES` / :data:`MAX_EXPANSIONS`, and binary or non-UTF-8 files are refused, each a one-line
:class:`MindSpeedConfigError` naming the file and line.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_mm.mindspeed.keys import MindSpeedConfigError

__all__ = [
    "Launch",
    "MindSpeedConfigError",
    "parse_script",
    "parse_args",
    "read_text_file",
    "MAX_SCRIPT_BYTES",
    "MAX_EXPANDED_BYTES",
    "MAX_EXPANSIONS",
]

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
_ARITHMETIC = re.compile(r"\$\(\(([0-9+\-*/%() \t]{1,200})\)\)")

MAX_SCRIPT_BYTES = 4 << 20
"""Largest launch script, YAML or entry script read (4 MiB)."""
MAX_EXPANDED_BYTES = 1 << 20
"""Most characters that variable expansion may produce over a whole script (1 MiB)."""
MAX_EXPANSIONS = 100_000
"""Most ``$VAR`` substitutions in one script."""
UNEVALUATED = "{unevaluated:"
"""How a value that comes from shell the reader does not run reads after expansion: ``{unevaluated:NNODES}``."""
_SHELL_KEYWORD = re.compile(r"^(source|\.|for|while|until|if|case|select|function)\s|^[A-Za-z_][\w-]*\s*\(\)\s*\{?")
_FLAG_WORD = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


@dataclass
class Launch:
    """What a launch consists of: launcher options, the entry script, and the training flags."""

    launcher: dict[str, str] = field(default_factory=dict)
    script: str | None = None
    flags: list[tuple[str, str | None]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    config_yaml: str | None = None
    """The YAML given to the entry script as its first argument (MindSpeed MM's single-YAML form)."""
    unevaluated: list[str] = field(default_factory=list)
    """Shell the reader does not evaluate (command substitution, arithmetic on such values, ``source``, loops and
    conditionals), each as ``line N: text``; a value that depends on it reads :data:`UNEVALUATED` ``NAME``."""
    unused: list[str] = field(default_factory=list)
    """Flags written in a variable that never reaches the launch line, as ``--flag (in NAME, line N)``."""


class _Expander:
    """``$VAR`` / ``${VAR}`` expansion with a budget: total output size and substitution count are bounded."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.produced = 0
        self.count = 0

    def __call__(self, text: str, env: dict[str, str], line: int) -> str:
        def substitute(match: re.Match[str]) -> str:
            self.count += 1
            value = env.get(match.group(1) or match.group(2), "")
            self.produced += len(value)
            if self.count > MAX_EXPANSIONS or self.produced > MAX_EXPANDED_BYTES:
                raise MindSpeedConfigError(
                    f"{self.source}:{line}: variable expansion grows past {MAX_EXPANDED_BYTES // 1024} KiB or "
                    f"{MAX_EXPANSIONS} substitutions (variables that repeat each other?); a launch script is small"
                )
            return value

        return _ARITHMETIC.sub(_arithmetic, _VAR.sub(substitute, text))


_ARITHMETIC_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.FloorDiv,
    ast.Div,
    ast.Mod,
    ast.USub,
    ast.UAdd,
)


def _arithmetic(match: re.Match[str]) -> str:
    """``$((8*2))`` -> ``16`` for integer arithmetic on small numbers; anything else is left as written."""
    try:
        tree = ast.parse(match.group(1).strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return match.group(0)
    nodes = list(ast.walk(tree))
    if not all(isinstance(node, _ARITHMETIC_NODES) for node in nodes) or any(
        isinstance(n, ast.Constant) and (type(n.value) is not int or n.value > 10**9) for n in nodes
    ):
        return match.group(0)

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant):
            assert type(node.value) is int  # checked for every constant above
            return node.value
        if isinstance(node, ast.UnaryOp):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        assert isinstance(node, ast.BinOp)
        left, right = value(node.left), value(node.right)
        if abs(left) > 10**18 or abs(right) > 10**18:
            raise OverflowError
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ZeroDivisionError
        return int(left / right) if isinstance(node.op, (ast.Div, ast.FloorDiv)) else left % right  # as the shell

    try:
        return str(value(tree))
    except (ZeroDivisionError, OverflowError, RecursionError):
        return match.group(0)


# One shell word piece: unquoted text, a '...' or "..." string, an escaped character; or whitespace (group 1), or
# anything else (group 2: an unterminated quote or a trailing backslash). Each alternative is linear: no backtracking.
_PIECE = re.compile(r"""[^\s'"\\]+|'[^']*'|"(?:[^"\\]|\\.)*"|\\.|(\s+)|(.)""", re.DOTALL)
_DOUBLE_QUOTED_ESCAPE = re.compile(r'\\([\\"$`\n])')


def _substitution_end(text: str, start: int) -> int:
    """The index after the ``)`` closing the ``$(`` (or ``$((``) at ``start``, quotes respected; -1 if unclosed."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _command_substitutions(text: str) -> list[str]:
    """The ``$(command)`` and backquoted commands of ``text`` (not ``$((arithmetic))``), outside single quotes."""
    found: list[str] = []
    i, quote = 0, ""
    while i < len(text):
        ch = text[i]
        if quote == "'":
            quote = "" if ch == "'" else quote
        elif ch == "'" and not quote:
            quote = "'"
        elif ch == "`":
            end = text.find("`", i + 1)
            found.append(text[i : (end + 1) if end >= 0 else len(text)])
            i = len(text) if end < 0 else end + 1
            continue
        elif text.startswith("$(", i) and not text.startswith("$((", i):
            end = _substitution_end(text, i + 1)
            found.append(text[i : end if end >= 0 else len(text)])
            i = len(text) if end < 0 else end
            continue
        i += 1
    return found


def _arithmetic_left(text: str) -> list[str]:
    """The ``$((...))`` that expansion could not compute (they use unevaluated values or shell syntax)."""
    found: list[str] = []
    i = text.find("$((")
    while i >= 0:
        end = _substitution_end(text, i + 1)
        found.append(text[i : end if end >= 0 else len(text)])
        i = -1 if end < 0 else text.find("$((", end)
    return found


def split_words(text: str) -> list[str]:
    """``shlex.split`` (POSIX quoting, no comments) in linear time with regular expressions: ``shlex`` takes
    about 10 microseconds a character, seconds for an expanded value of a few hundred kB."""
    words: list[str] = []
    current: list[str] = []
    in_word = False
    for match in _PIECE.finditer(text):
        piece = match.group(0)
        if match.group(1) is not None:
            if in_word:
                words.append("".join(current))
                current, in_word = [], False
            continue
        if match.group(2) is not None:
            raise MindSpeedConfigError("No closing quotation" if piece in "'\"" else "No escaped character")
        in_word = True
        if piece[0] == "'":
            current.append(piece[1:-1])
        elif piece[0] == '"':
            current.append(_DOUBLE_QUOTED_ESCAPE.sub(r"\1", piece[1:-1]))
        elif piece[0] == "\\":
            current.append(piece[1])
        else:
            current.append(piece)
    if in_word:
        words.append("".join(current))
    return words


def _split_flags(tokens: list[str]) -> list[tuple[str, str | None]]:
    flags: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            flags.append((token, None))  # a stray value, reported as unmapped
            i += 1
            continue
        if "=" in token:
            name, value = token.split("=", 1)
            flags.append((name, value))
            i += 1
            continue
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if nxt is not None and (not nxt.startswith("--") or re.fullmatch(r"-[\d.e+-]+", nxt)):
            flags.append((token, nxt))
            i += 2
        else:
            flags.append((token, None))
            i += 1
    return flags


def parse_args(tokens: Sequence[str]) -> Launch:
    """A launch given as an argument list (training flags only)."""
    return Launch(flags=_split_flags(list(tokens)))


def _logical_lines(text: str, source: str) -> list[tuple[int, str]]:
    """Shell lines as ``(first line number, text)``: continuations joined, comments dropped, quoted values over
    several lines kept together. One pass over the text, so linear time whatever the quoting."""
    lines: list[tuple[int, str]] = []
    current: list[str] = []
    quote, quote_line = "", 0  # the open quote character ("" outside quotes) and its line
    line_no = start = 1
    word_start = True
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if quote:
            if ch == "\\" and quote != "'" and i + 1 < n:
                if text[i + 1] == "\n":  # a continuation inside double quotes
                    line_no += 1
                    i += 2
                    continue
                current.append(text[i : i + 2])
                i += 2
                continue
            if ch == quote:
                quote = ""
            elif ch == "\n":
                line_no += 1
            current.append(ch)
            i += 1
            continue
        if ch == "\\" and text.startswith("\n", i + 1):
            current.append(" ")
            line_no, i = line_no + 1, i + 2
            continue
        if ch == "\\" and text.startswith("\r\n", i + 1):
            current.append(" ")
            line_no, i = line_no + 1, i + 3
            continue
        if ch == "\\" and i + 1 < n:
            current.append(text[i : i + 2])
            word_start, i = False, i + 2
            continue
        if ch == "#" and word_start:
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if ch == "\n":
            joined = "".join(current).strip()
            if joined:
                lines.append((start, joined))
            current = []
            line_no += 1
            start, word_start, i = line_no, True, i + 1
            continue
        if ch in "'\"`":
            quote, quote_line = ch, line_no
        current.append(ch)
        word_start = ch in " \t;|&("
        i += 1
    if quote:
        raise MindSpeedConfigError(f"{source}:{quote_line}: unterminated {quote} quote")
    joined = "".join(current).strip()
    if joined:
        lines.append((start, joined))
    return lines


def read_text_file(path: Path, what: str) -> str:
    """A small UTF-8 text file; a binary, non-UTF-8 or oversized file is a one-line error naming the file."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SCRIPT_BYTES + 1)
    except OSError as err:
        raise MindSpeedConfigError(f"cannot read {what} {path}: {err.strerror or err}") from None
    if len(raw) > MAX_SCRIPT_BYTES:
        raise MindSpeedConfigError(f"{path}: larger than {MAX_SCRIPT_BYTES >> 20} MiB; {what} is expected to be small")
    if b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        raise MindSpeedConfigError(f"{path}:{line}: a binary file (NUL byte), not {what}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise MindSpeedConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x}); {what} must be UTF-8"
        ) from None


def _cut_command(line: str) -> str:
    """The launch line up to its first unquoted pipe, list operator or redirection (``2>&1 | tee log``), found
    before expansion: as in the shell, a ``<`` or ``|`` that a variable expands to is a word, not an operator."""
    quote, depth, i = "", 0, 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch == "\\":
            i += 2
            continue
        elif ch in "'\"`":
            quote = ch
        elif line.startswith("$(", i):
            depth += 1
            i += 2
            continue
        elif ch == ")" and depth:
            depth -= 1
        elif ch in "|;&<>" and not depth:
            start = i
            while start > 0 and line[start - 1].isdigit():
                start -= 1
            if start == 0 or line[start - 1] in " \t":
                return line[:start]
        i += 1
    return line


def _is_launch_line(line: str) -> bool:
    return bool(re.search(r"(^|\s)(torchrun|python3?)\s", line)) and ".py" in line


def parse_script(text: str, source: str = "the launch script") -> Launch:
    """A launch given as a shell script (``source`` names it in messages).

    Shell the reader does not run is named in :attr:`Launch.unevaluated` and never hides the rest: a variable set
    by command substitution (``NNODES=$(cat $HOSTFILE | wc -l)``) or by arithmetic on such a value reads
    ``{unevaluated:NNODES}`` wherever it is used, so the flags around it are kept.
    """
    env: dict[str, str] = {}
    expand = _Expander(source)
    launch_line = None
    launch_no = 0
    unevaluated: list[str] = []
    written: list[tuple[str, str, int]] = []  # (flag, variable, line) of every flag written in an assignment
    for number, line in _logical_lines(text, source):
        is_launch = _is_launch_line(line)
        assign = _ASSIGN.match(line)
        if assign and not is_launch:
            name, raw = assign.group(1), assign.group(2).strip()
            written += [(flag, name, number) for flag in _FLAG_WORD.findall(raw)]
            commands = _command_substitutions(raw)
            if commands:
                unevaluated.append(f"line {number}: {name}={raw} (command substitution)")
                env[name] = f"{UNEVALUATED}{name}}}"
                continue
            value = expand(raw, env, number)
            left = _arithmetic_left(value)
            if left:
                unevaluated.append(f"line {number}: {name}={raw} (arithmetic on values not evaluated)")
                for expression in left:
                    value = value.replace(expression, f"{UNEVALUATED}{name}}}")
            try:
                value = " ".join(split_words(value))
            except ValueError:
                value = value.strip("\"'")
            env[name] = value
            continue
        if is_launch:
            launch_line, launch_no = expand(_cut_command(line), env, number), number
            for command in _command_substitutions(launch_line):
                unevaluated.append(f"line {number}: {command} on the launch line (command substitution)")
                launch_line = launch_line.replace(command, f"{UNEVALUATED}line {number}}}")
        elif _SHELL_KEYWORD.match(line):
            unevaluated.append(f"line {number}: {line[:120]} (not run: only assignments and the launch line are read)")
    if launch_line is None:
        raise MindSpeedConfigError("no `torchrun ... xxx.py` or `python ... xxx.py` launch line found in the script")
    try:
        tokens = split_words(launch_line)
    except ValueError as err:
        raise MindSpeedConfigError(f"{source}:{launch_no}: cannot split the launch line: {err}") from None
    while tokens and not re.search(r"(^|/)(torchrun|python3?)$", tokens[0]):
        tokens.pop(0)  # e.g. `nohup`, environment prefixes
    if not tokens:
        raise MindSpeedConfigError(f"{source}:{launch_no}: no torchrun / python command on the launch line")
    tokens.pop(0)
    launcher: dict[str, str] = {}
    script = None
    while tokens:
        token = tokens.pop(0)
        if token.endswith(".py"):
            script = token
            break
        if token in ("-m",):
            tokens.pop(0) if tokens else None
            continue
        if token.startswith("--"):
            name, _, value = token.partition("=")
            if not value and tokens and not tokens[0].startswith("-") and not tokens[0].endswith(".py"):
                value = tokens.pop(0)
            launcher[name.lstrip("-").replace("-", "_")] = value
    if script is None:
        raise MindSpeedConfigError(f"{source}:{launch_no}: no entry script (`xxx.py`) on the launch line")
    config_yaml = None
    if tokens and tokens[0].endswith((".yaml", ".yml")):  # MindSpeed MM: `pretrain_transformers.py cfg.yaml`
        config_yaml = tokens.pop(0)
    flags = _split_flags(tokens)
    passed = (
        {flag for flag, _ in flags}
        | {f"--{key}" for key in launcher}
        | {f"--{key.replace('_', '-')}" for key in launcher}
    )
    unused = [f"{flag} (in {name}, line {line})" for flag, name, line in written if flag not in passed]
    return Launch(
        launcher=launcher,
        script=script,
        flags=flags,
        env=env,
        config_yaml=config_yaml,
        unevaluated=unevaluated,
        unused=unused,
    )
