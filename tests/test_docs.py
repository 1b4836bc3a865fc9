"""The README and every page under docs/ say only what holds: their links, YAML, commands and scripts are checked.

For README.md and each ``docs/*.md``:

- every relative Markdown link names an existing file, and its ``#anchor`` (if any) a heading of that file
  (GitHub's anchor rule: lower case, punctuation dropped, spaces to ``-``);
- every ```yaml block parses with ``yaml.safe_load``; one whose top level has any ``FSDP2Config`` key is an FSDP2
  config and loads with ``FSDP2Config.from_dict``. Placeholder rule: a block containing ``...`` or a ``<word>``
  placeholder (e.g. ``<model dir>``) is an excerpt, not a file, and is skipped (none is today), and
  the test fails if every block were skipped;
- every ```python block is valid Python (``ast.parse``) and its imports run; the README's example trains as
  written (2 CPU ranks, MindSpeed MM's custom model and provider in place of its placeholders); the other pages'
  examples name a user's model, data or 8 devices and are not run;
- every ``lightning-mm <command> [<subcommand>] ... --flag`` in a ```bash block names a command (and, where the
  command has subcommands, a subcommand) and flags that ``lightning-mm <command> [<subcommand>] --help`` lists
  (``--help`` run once per command in a subprocess);
- every ``python path/to/file.py`` or ``bash path/to/file.sh`` in a ```bash block or an inline code span names a
  file of the repository (a name without a folder, such as ``python train.py``, is the user's own script).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from lightning_mm.core.config import FSDP2Config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]
FSDP2_KEYS = {f.name for f in fields(FSDP2Config)}
PLACEHOLDER = re.compile(r"\.\.\.|<[A-Za-z][\w .-]*>")


def _blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, first line number) of each fenced block."""
    out, lang, body, start = [], None, [], 0
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, start = line[3:].strip() or "text", [], number + 1
            else:
                out.append((lang, "\n".join(body), start))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, "unclosed code block"
    return out


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def _shell_commands(body: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, split at ``&&``, ``;``, ``|``."""
    commands = []
    for line in body.replace("\\\n", " ").split("\n"):
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, ";"]:
            if word in {"&&", ";", "|", "||"}:
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


@functools.cache
def _help(*command: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_mm.cli", *command, "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, f"lightning-mm {' '.join(command)} --help failed:\n{done.stderr[-2000:]}"
    return done.stdout


def _choices(help_text: str) -> set[str]:
    """The subcommands a --help offers (argparse lists them as ``{a,b,c}`` first under its positional arguments)."""
    found = re.search(r"^(?:usage: \S+|positional arguments:\n)\s+\{([\w,-]+)\}", help_text, flags=re.M)
    return set(found.group(1).split(",")) if found else set()


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            bad.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(f"{target}: no heading #{anchor}")
    assert bad == []


def test_yaml_blocks_load():
    checked = fsdp2 = 0
    for page in PAGES:
        for lang, body, line in _blocks(page.read_text(encoding="utf-8")):
            if lang not in {"yaml", "yml"} or PLACEHOLDER.search(body):
                continue
            where = f"{page.relative_to(ROOT)}:{line}"
            data = yaml.safe_load(body)
            checked += 1
            if isinstance(data, dict) and FSDP2_KEYS & set(data):
                FSDP2Config.from_dict(data, source=where)
                fsdp2 += 1
    assert checked >= 3 and fsdp2 >= 1  # the pages' YAML is checked, not skipped


def test_python_blocks_parse():
    count = 0
    for page in PAGES:
        for lang, body, line in _blocks(page.read_text(encoding="utf-8")):
            if lang == "python":
                ast.parse(body, filename=f"{page.relative_to(ROOT)}:{line}")
                count += 1
    assert count >= 3


def _bash_commands():
    for page in PAGES:
        for lang, body, line in _blocks(page.read_text(encoding="utf-8")):
            if lang in {"bash", "sh", "shell", "console"}:
                for words in _shell_commands(body):
                    yield f"{page.relative_to(ROOT)}:{line}", words


def test_cli_commands_and_flags_exist():
    seen = 0
    for where, words in _bash_commands():
        if words[0] != "lightning-mm":
            continue
        seen += 1
        command = [words[1]]
        assert command[0] in _choices(_help()), f"{where}: no command `lightning-mm {command[0]}`"
        subcommands = _choices(_help(*command))
        if subcommands:
            assert words[2] in subcommands, f"{where}: no subcommand `lightning-mm {command[0]} {words[2]}`"
            command.append(words[2])
        listed = set(re.findall(r"--[\w.-]+", _help(*command)))
        flags = {m for word in words[1:] for m in re.findall(r"^\[?(--[\w.-]+)", word)}
        assert flags <= listed, f"{where}: `lightning-mm {' '.join(command)}` has no {sorted(flags - listed)}"
    assert seen >= 10


def test_named_scripts_exist():
    inline = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        for span in re.findall(r"`([^`\n]+)`", prose):
            try:
                inline.append((page.relative_to(ROOT), shlex.split(span)))
            except ValueError:  # not shell words (unbalanced quotes): not a command
                continue
    named = [*_bash_commands(), *inline]
    missing, count = [], 0
    for where, words in named:
        for runner, script in zip(words, words[1:]):
            if (runner, Path(script).suffix) in {("python", ".py"), ("bash", ".sh")} and "/" in script:
                count += 1
                if not (ROOT / script).is_file():
                    missing.append(f"{where}: {runner} {script}")
    assert missing == [] and count >= 4


def _python_blocks(page: Path) -> list[tuple[str, int]]:
    return [(body, line) for lang, body, line in _blocks(page.read_text(encoding="utf-8")) if lang == "python"]


def test_python_blocks_import_what_exists():
    """Every import of every ```python block runs: the names a page tells users to import exist."""
    imports = 0
    for page in PAGES:
        for body, line in _python_blocks(page):
            for node in ast.walk(ast.parse(body)):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    code = ast.unparse(node)
                    try:
                        exec(code, {})
                    except ImportError as err:
                        raise AssertionError(f"{page.relative_to(ROOT)}:{line}: `{code}` fails: {err}") from None
                    imports += 1
    assert imports >= 8


README_PRELUDE = """\
import sys
sys.path[:0] = [{root!r}, {custom!r}]
from model import TinyVLM as CustomModel, TinyVLMConfig
from examples.custom_model.train import train_valid_test_datasets_provider as provider
config = TinyVLMConfig()
"""


def test_the_readme_example_trains(tmp_path):
    """The README's Python example runs as written, on 2 CPU ranks, with MindSpeed MM's custom model and provider."""
    (body, line), *_ = _python_blocks(ROOT / "README.md")
    custom = ROOT / "examples" / "custom_model"
    (tmp_path / "fsdp2_config.yaml").write_text((custom / "fsdp2_config.yaml").read_text())
    script = tmp_path / "example.py"
    script.write_text(README_PRELUDE.format(root=str(ROOT), custom=str(custom)) + body + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README.md:{line}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "`Trainer.fit` stopped: `max_steps=20` reached." in done.stdout + done.stderr
