"""One error family: every error lightning-mm raises on purpose is a ``LightningMMError`` (plus the builtin it refines).

The package is read with :mod:`ast` (nothing is imported for the scans): a ``raise`` of a bare builtin exception
fails unless it is a true programming error listed in ``_ALLOWED_RAISES`` with its reason, and every exception
class defined in the package must derive from ``LightningMMError`` unless listed in ``_ALLOWED_CLASSES``.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mm"

_BUILTIN_EXCEPTIONS = frozenset(
    name
    for name in dir(builtins)
    if isinstance(getattr(builtins, name), type) and issubclass(getattr(builtins, name), BaseException)
)


# (file under lightning_mm/, function's qualified name) -> why a bare builtin is right there (a programming error or
# a protocol, never bad input).
_ALLOWED_RAISES: dict[tuple[str, str], str] = {
    ("__init__.py", "__getattr__"): "the module __getattr__ protocol: AttributeError for an unknown name",
    ("_compat.py", "__getattr__"): "the module __getattr__ protocol: AttributeError for an unknown name",
    ("hf/derived_adapters.py", "__getattr__"): "the module __getattr__ protocol: AttributeError for an unknown name",
    ("_compat.py", "local_offsets"): "an internal caller passed a DTensor layout the sharding never produces",
    ("checkpoint/atomic.py", "_exchange"): "re-raises the errno of a failed renameat2 system call as OSError",
    ("core/vision_work_balance.py", "assign_images"): "internal invariant: one cost per image, computed by the caller",
    (
        "core/vision_work_balance.py",
        "_all_to_all",
    ): "internal invariant: the route and the rows sent come from one plan",
    ("data/replacing.py", "ReplacingDataset.sample"): "abstract method: subclasses implement it",
    ("data/replacing.py", "ReplacingDataset.limit_replacements"): "internal invariant: one length per record",
    ("hf/loading.py", "_fill"): "internal invariant: the load plan and the local shard were computed together",
    ("modules/lightning_module.py", "MMLightningModule.model_provider"): "abstract hook: override it or pass one",
    ("core/module_state.py", "move_buffer"): "internal invariant: callers move buffers they listed on the module",
    ("checkpoint/formats.py", "CheckpointFormat.write"): "abstract method: each format class implements it",
    ("checkpoint/formats.py", "CheckpointFormat.read"): "abstract method: each format class implements it",
    ("checkpoint/formats.py", "register_format"): "two classes registered under one format name (a bug)",
    ("checkpoint/writer.py", "StorageFormat.payload"): "abstract method: each storage layout implements it",
    ("checkpoint/writer.py", "StorageFormat.write_partial"): "abstract method: each storage layout implements it",
    ("core/ring_attention.py", "zigzag_index"): "internal invariant: the caller pads the sequence to 2 x size chunks",
    ("mindspeed/flags.py", "_strategy_arg"): "the flag table names a strategy argument that does not exist (a bug)",
    ("mindspeed/launch_script.py", "_arithmetic.value"): (
        "control flow of the shell-arithmetic reader: caught by it, the expression is then named as not evaluated"
    ),
    ("mindspeed/refusals.py", "Refused.__init__"): "a refusal code missing from the documented table (a bug)",
    ("data/record_files.py", "_token_ids"): (
        "caught at once with the tokenizer's own errors; the bad-record report names the builtin type"
    ),
}

# exception classes defined in the package that are deliberately not part of the family, with the reason
_ALLOWED_CLASSES: dict[tuple[str, str], str] = {
    ("_utils/yaml_io.py", "_Limit"): "private control flow of the YAML loader, turned into ConfigFileError",
    ("checkpoint/atomic.py", "_Raced"): "private control flow of the atomic commit, never leaves the module",
}


def _files() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _raised_builtins(tree: ast.Module) -> list[tuple[str, str, int]]:
    """(qualified function name, builtin exception name, line) of each ``raise`` of a bare builtin in ``tree``."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in _BUILTIN_EXCEPTIONS:
                    found.append((".".join(scope), exc.id, child.lineno))
            visit(child, scope)

    visit(tree, [])
    return found


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def test_no_bare_builtin_raise_outside_the_allow_list() -> None:
    bare, allowed_seen = [], set()
    for rel, tree in _files():
        for function, name, line in _raised_builtins(tree):
            if (rel, function) in _ALLOWED_RAISES:
                allowed_seen.add((rel, function))
            else:
                bare.append(f"lightning_mm/{rel}:{line} ({function or 'module'}): raise {name}")
    assert not bare, (
        "raise an error of lightning_mm.errors (or a subclass) instead of a bare builtin, or list a true "
        "programming error in _ALLOWED_RAISES with its reason:\n" + "\n".join(bare)
    )
    stale = sorted(set(_ALLOWED_RAISES) - allowed_seen)
    assert not stale, f"_ALLOWED_RAISES lists functions that raise no bare builtin any more: {stale}"


def test_every_exception_class_derives_from_lightning_mm_error() -> None:
    classes: dict[str, list[tuple[str, list[str]]]] = {}
    for rel, tree in _files():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b for b in (_base_name(base) for base in node.bases) if b is not None]
                classes.setdefault(node.name, []).append((rel, bases))

    def derives(name: str, target: set[str], seen: frozenset[str] = frozenset()) -> bool:
        if name in target:
            return True
        if name in seen or name not in classes:
            return False
        return any(derives(base, target, seen | {name}) for _, bases in classes[name] for base in bases)

    exception_roots = set(_BUILTIN_EXCEPTIONS) | {"UnpicklingError", "CheckpointException"}
    outside = []
    for name, definitions in classes.items():
        for rel, bases in definitions:
            if not any(derives(base, exception_roots) for base in bases):
                continue
            if (rel, name) in _ALLOWED_CLASSES:
                continue
            if not any(derives(base, {"LightningMMError"}) for base in bases) and name != "LightningMMError":
                outside.append(f"lightning_mm/{rel}: class {name}({', '.join(bases)})")
    assert not outside, "exception classes outside the LightningMMError family:\n" + "\n".join(outside)


def test_the_documented_example_is_true() -> None:
    from lightning_mm.core.config import FSDP2ConfigError
    from lightning_mm.errors import LightningMMError

    assert issubclass(FSDP2ConfigError, LightningMMError) and issubclass(FSDP2ConfigError, ValueError)


def test_one_checkpoint_error_hierarchy(tmp_path: Path) -> None:
    from lightning_mm import checkpoint
    from lightning_mm.checkpoint import checkpoint_errors as errors
    from lightning_mm.errors import LightningMMError
    from lightning_mm.hf import pretrained_index

    assert pretrained_index.CheckpointError is errors.CheckpointError is checkpoint.CheckpointError
    assert issubclass(errors.CheckpointError, LightningMMError)
    truncated = tmp_path / "model.safetensors"
    truncated.write_bytes(b"\x01")
    with pytest.raises(checkpoint.CheckpointError, match="too short to be a safetensors file") as caught:
        pretrained_index.read_safetensors_header(truncated)
    assert isinstance(caught.value, ValueError)  # as before the merge: `except ValueError` still catches it


def _raise_in(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001 - caught to keep its traceback
        return caught


def test_the_cli_recognises_its_errors_by_type() -> None:
    from lightning_mm.commands.failure import user_error
    from lightning_mm.core.vision_work_balance import assign_images
    from lightning_mm.errors import ConfigError, LightningMMError

    class ForeignModuleError(LightningMMError, ValueError):
        pass

    ours = _raise_in(ForeignModuleError("a: bad value"))
    assert user_error(ours) is ours  # a LightningMMError defined anywhere (here: in a test module) is the user's

    wrapped = _raise_in(RuntimeError("while loading"))
    wrapped.__cause__ = ConfigError("b: bad value")
    assert user_error(wrapped) is wrapped.__cause__

    class NotInTheFamily(ValueError):
        pass

    NotInTheFamily.__module__ = "lightning_mm.pretend"  # the module name no longer decides
    assert user_error(_raise_in(NotInTheFamily("x"))) is None

    with pytest.raises(ValueError) as bug:  # a programming error of lightning-mm's own code keeps its traceback
        assign_images([1.0], [0, 1], 2)
    assert not isinstance(bug.value, LightningMMError)
    assert user_error(bug.value) is None
