"""The package's layers import one way and without cycles (issue #14).

Every ``import`` in ``lightning_mm`` (module level and inside functions) is read from the source. From the bottom:
0. leaf helpers (``lightning_mm._*``, ``errors``, ``npu_probe``), 1. the FSDP2 core (``core``), 2. checkpoint I/O
(``checkpoint``), 3. the Hugging Face integration (``hf``), 4. the Lightning layer (``strategies``, ``modules``,
``datamodules``, ``accelerators``), 5. commands, the CLI and the package root. A module may import its own layer
and those below; no module takes part in an import cycle, and neither does any sub-package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_mm"

LAYERS: list[tuple[str, int]] = [
    ("lightning_mm.core", 1),
    ("lightning_mm.checkpoint", 2),
    ("lightning_mm.hf", 3),
    ("lightning_mm.diffusers", 3),
    ("lightning_mm.testing", 3),  # tiny random models for the examples and tests (Transformers, no Lightning)
    ("lightning_mm.strategies", 4),
    ("lightning_mm.modules", 4),
    ("lightning_mm.datamodules", 4),
    ("lightning_mm.accelerators", 4),
    ("lightning_mm.commands", 5),
    ("lightning_mm.cli", 5),
]
LEAVES = ("lightning_mm.errors", "lightning_mm.npu_probe")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    if module == "lightning_mm":
        return 5
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    if module in LEAVES or module.split(".")[1].startswith("_"):
        return 0
    raise AssertionError(f"{module}: no layer assigned; add it to tests/test_layers.py::LAYERS")


def import_edges() -> dict[str, set[str]]:
    """module -> the lightning_mm modules it imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if target.startswith("lightning_mm") and target != name:
                    edges[name].add(target)
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_import_goes_down_or_across():
    wrong = [
        f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})"
        for src, targets in import_edges().items()
        for dst in sorted(targets)
        if layer_of(dst) > layer_of(src)
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_module_cycle():
    assert _cycle(import_edges()) is None, f"import cycle: {' -> '.join(_cycle(import_edges()) or [])}"


def _subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_subpackage_cycle():
    graph: dict[str, set[str]] = {}
    for src, targets in import_edges().items():
        graph.setdefault(_subpackage(src), set()).update(
            _subpackage(t) for t in targets if _subpackage(t) != _subpackage(src) and t != "lightning_mm"
        )
    assert _cycle(graph) is None, f"sub-package cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_checker_sees_a_wrong_import_and_a_cycle():
    assert layer_of("lightning_mm.core.plan") < layer_of("lightning_mm.strategies.fsdp2")
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    ("package", "absent"),
    [
        ("lightning_mm.core", ("lightning", "lightning.pytorch", "transformers", "peft")),
        ("lightning_mm.checkpoint", ("lightning", "lightning.pytorch", "transformers", "peft")),
        ("lightning_mm.hf", ("lightning", "lightning.pytorch")),
        ("lightning_mm.diffusers", ("lightning", "lightning.pytorch")),
    ],
)
def test_lower_layers_load_without_lightning(package, absent):
    """Importing the whole layer (every module in it) leaves Lightning (and, below the HF layer, Transformers) out."""
    names = sorted(m for m in _modules() if m == package or m.startswith(package + "."))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n    importlib.import_module(name)\n"
        f"print(sorted(m for m in {list(absent)!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"{package} imports {out.stdout.strip()}"


@pytest.mark.parametrize(
    "path",
    [
        "lightning_mm.strategies.expert_parallel.routed_forward",
        "lightning_mm.strategies.context_parallel.split_sequence",
        "lightning_mm.modules.lora.apply_lora",
        "lightning_mm.modules.lora_export.save_lora_adapters",
        "lightning_mm.modules.lora_export.save_merged_model",
        "lightning_mm.modules.TransformersModel",
        "lightning_mm.modules.FSDP2Mixin",
        "lightning_mm.strategies.MMFSDP2Strategy",
        "lightning_mm.modules.wan_module.MMWanModule",
        "lightning_mm.diffusers.export.dcp_to_diffusers",
    ],
)
def test_public_paths_named_in_the_readme_still_import(path):
    import importlib

    module, _, attr = path.rpartition(".")
    assert getattr(importlib.import_module(module), attr) is not None
