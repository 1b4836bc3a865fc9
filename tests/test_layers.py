"""The package's layers import one way and without cycles (issue #14).

Every ``import`` in ``lightning_mm`` (module level and inside functions) is read from the source. From the bottom:
0. leaf helpers (``lightning_mm._*``, ``errors``, ``npu_probe``), 1. the FSDP2 core (``core``), 2. checkpoint I/O
(``checkpoint``), 3. the Hugging Face integration and the Lightning-free datasets (``hf``, ``diffusers``, ``data``),
4. the MindSpeed MM translation layer (``mindspeed``, issue #36), 5. the Lightning layer (``strategies``,
``modules``, ``datamodules``, ``accelerators``), 6. commands, the CLI and the package root. A module may import its
own layer and those below; no module takes part in an import cycle, and neither does any sub-package.
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
    ("lightning_mm.data", 3),
    ("lightning_mm.mindspeed", 4),
    ("lightning_mm.strategies", 5),
    ("lightning_mm.modules", 5),
    ("lightning_mm.datamodules", 5),
    ("lightning_mm.accelerators", 5),
    ("lightning_mm.commands", 6),
    ("lightning_mm.cli", 6),
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
        return 6
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
    assert layer_of("lightning_mm.core.sharding_plan") < layer_of("lightning_mm.strategies.fsdp2")
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    ("package", "absent"),
    [
        ("lightning_mm.core", ("lightning", "lightning.pytorch", "transformers", "peft")),
        ("lightning_mm.checkpoint", ("lightning", "lightning.pytorch", "transformers", "peft")),
        ("lightning_mm.hf", ("lightning", "lightning.pytorch")),
        ("lightning_mm.diffusers", ("lightning", "lightning.pytorch")),
        ("lightning_mm.data", ("lightning", "lightning.pytorch")),
        ("lightning_mm.mindspeed", ("lightning", "lightning.pytorch")),
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
        "lightning_mm.core.expert_parallel.routed_forward",
        "lightning_mm.core.context_parallel.split_sequence",
        "lightning_mm.hf.lora.apply_lora",
        "lightning_mm.hf.lora_export.save_lora_adapters",
        "lightning_mm.hf.lora_export.save_merged_model",
        "lightning_mm.modules.TransformersModel",
        "lightning_mm.modules.FSDP2Mixin",
        "lightning_mm.strategies.MMFSDP2Strategy",
        "lightning_mm.modules.wan_module.MMWanModule",
        "lightning_mm.diffusers.wan_export.dcp_to_diffusers",
    ],
)
def test_public_paths_named_in_the_readme_still_import(path):
    import importlib

    module, _, attr = path.rpartition(".")
    assert getattr(importlib.import_module(module), attr) is not None


# MindSpeed MM's own names, chosen so that none of them is also a lightning-mm key or a word of ordinary code: its
# Megatron flags (``--mm-data``...), its single YAML's sections (``gpt_args``, ``lora_args``), its model.json's
# towers (``image_encoder``, ``text_decoder``), its native route's ``parallel:`` keys (``fully_shard_parallel_size``,
# ``ulysses_parallel_size``, ``fsdp_plan``, ``ep_plan``, ``recompute_plan``), its data config's sections and keys
# (``dataset_param``, ``basic_parameters``, ``data_folder``...) and entry scripts. Keys that lightning-mm shares
# (``init_from_hf_path``, ``sub_modules_to_wrap``, ``model_id``) are left out.
MINDSPEED_NAMES = (
    "gpt_args",
    "lora_args",
    "MM_TOOL_PATH",
    "--mm-data",
    "--mm-model",
    "--use-torch-fsdp2",
    "--fsdp2-config-path",
    "--micro-batch-size",
    "--global-batch-size",
    "--tensor-model-parallel-size",
    "image_encoder",
    "text_decoder",
    "fully_shard_parallel_size",
    "ulysses_parallel_size",
    "ring_attention_size",
    "fsdp_plan",
    "ep_plan",
    "recompute_plan",
    "pretrain_transformers.py",
    "pretrain_vlm.py",
    "dataset_param",
    "dataloader_param",
    "val_dataset_param",
    "basic_parameters",
    "preprocess_parameters",
    "collate_param",
    "dataloader_mode",
    "sampler_type",
    "data_folder",
    "data_path",
)
TRANSLATION = "lightning_mm.mindspeed"
# Modules outside the translation layer that still name one of MINDSPEED_NAMES, each with why (issue #36: none may
# be added; remove an entry when its module stops naming them).
STILL_NAMING: dict[str, str] = {}


def _string_literals(path: Path) -> list[str]:
    """The string constants of a module (f-string parts included), docstrings left out: a docstring may say what
    MindSpeed MM calls a thing; code that reads or writes its keys may not live outside the translation layer."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _names_in(text: str) -> set[str]:
    import re

    return {n for n in MINDSPEED_NAMES if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)}


def test_only_the_translation_layer_names_mindspeed_keys():
    """Only ``lightning_mm/mindspeed/`` names MindSpeed MM's keys and flags (DESIGN.md: one translation layer)."""
    found = {
        name: sorted(set().union(*(_names_in(s) for s in _string_literals(path))))
        for name, path in _modules().items()
        if not (name == TRANSLATION or name.startswith(TRANSLATION + "."))
    }
    wrong = {name: keys for name, keys in found.items() if keys and name not in STILL_NAMING}
    assert not wrong, "MindSpeed MM names outside lightning_mm/mindspeed/: " + repr(wrong)
    assert not [name for name in STILL_NAMING if not found.get(name)], "stale STILL_NAMING entries"


def test_the_key_check_sees_a_mindspeed_key():
    assert _names_in("`gpt_args.lr`") == {"gpt_args"} and _names_in("--mm-data-x gpt_argsx") == set()
    assert any("gpt_args" in s for s in _string_literals(PACKAGE / "mindspeed" / "load.py"))
    assert _names_in("`dataset_param.basic_parameters`") == {"dataset_param", "basic_parameters"}
    assert any("dataset_param" in s for s in _string_literals(PACKAGE / "mindspeed" / "mindspeed_data.py"))


def test_the_translation_layer_imports_no_lightning_layer():
    """``lightning_mm/mindspeed/`` imports only the core, checkpoint, Hugging Face and diffusers layers below it."""
    wrong = [
        f"{src} imports {dst}"
        for src, targets in import_edges().items()
        if src == TRANSLATION or src.startswith(TRANSLATION + ".")
        for dst in targets
        if layer_of(dst) > layer_of(TRANSLATION)
    ]
    assert not wrong, wrong


def test_no_two_modules_share_a_name():
    """A module's name says which layer it belongs to: no file name (``__init__.py`` aside) is used twice in the
    package (issue #41: ``packing``, ``records``, ``plan``, ... existed in several layers)."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_the_package_root_holds_no_small_private_modules():
    """Private helpers live in ``lightning_mm/_utils/`` grouped by concern; the root keeps the compat fence only."""
    assert sorted(p.name for p in PACKAGE.glob("_*.py") if p.name != "__init__.py") == ["_compat.py"]
