"""Print the Markdown table of the FSDP2 YAML keys from `FSDP2Config`'s field docstrings.

    python scripts/config_table.py            # print the table
    python scripts/config_table.py --write    # replace the table between the markers in docs/strategy.md

Each field's docstring (the string literal after it in `lightning_mm/core/config.py`) is the one description of
the key; `tests/test_config_docs.py` checks that every field has one and that docs/strategy.md shows this table.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "lightning_mm" / "core" / "config.py"
DOC = ROOT / "docs" / "strategy.md"
BEGIN, END = "<!-- yaml-keys:begin (scripts/config_table.py --write) -->", "<!-- yaml-keys:end -->"
INTERNAL = {"source"}  # fields that are not YAML keys


def field_docs(path: Path = CONFIG, cls: str = "FSDP2Config") -> dict[str, str | None]:
    """Each field of the dataclass ``cls`` in ``path`` -> its docstring (whitespace folded), ``None`` if it has none."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out: dict[str, str | None] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        doc = None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            doc = " ".join(after.value.value.split())
        out[node.target.id] = doc
    return out


def _yaml_value(value: object) -> str:
    if value is None or isinstance(value, bool):
        return {None: "unset", True: "true", False: "false"}[value]
    return str(value)


def table() -> str:
    sys.path.insert(0, str(ROOT))
    from lightning_mm.core.config import FSDP2Config

    defaults = FSDP2Config().to_dict()
    docs = field_docs()
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name, default in defaults.items():
        doc = docs.get(name)
        if name not in INTERNAL:
            default = _yaml_value(default)
            meaning = (doc or "").replace("|", r"\|")
            rows.append(f"| `{name}` | `{default}` | {meaning} |")
    return "\n".join(rows)


def write(doc: Path = DOC) -> None:
    text = doc.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{table()}\n{END}{tail}", encoding="utf-8")


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
    else:
        print(table())
