"""``lightning_mm.core.module_state`` is the one place that writes onto a user's module (issue #24, item 5).

A source scan finds writes onto modules elsewhere in the model-facing packages (and is itself checked against
snippets that re-add each kind of write); the behavioural tests check that every write the core makes is
recorded, listed by ``describe_module_changes`` and undoable, and that nothing else is left on the modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_mm
from lightning_mm.core import module_state
from lightning_mm.core.apply import apply_compile, apply_recompute, model_unit_sharding
from lightning_mm.core.config import FSDP2Config
from lightning_mm.core.sharding_plan import build_plan, plan_in_use

PACKAGE = Path(lightning_mm.__file__).parent
SCANNED = ("core", "hf", "modules", "diffusers")
THE_ONE_PLACE = PACKAGE / "core" / "module_state.py"

MODULE_NAMES = frozenset(
    "module mod model target root owner sub submodule child parent layer block decoder encoder predictor "
    "experts expert head tower shell m net wrapped unit wan".split()
)
"""Variable names that hold a module in this code base; an attribute written through one is a write onto it."""

PRIVATE_DICTS = frozenset({"_parameters", "_buffers", "_modules", "__dict__"})

ALLOWED = {
    # Modules these files create themselves (LoRA's meta-device shells), not the user's.
    ("hf/lora.py", "shell.in_features"),
    ("hf/lora.py", "shell.out_features"),
    ("hf/lora.py", "shell.weight"),
    # The model viewed as its Transformers base class inside a ``with`` (restored on exit).
    ("hf/pretrained_index.py", "model.__class__"),
}
"""``(file, written expression)`` writes outside ``module_state`` that are known and not the core's."""


def _chain(node: ast.AST) -> list[str]:
    """The names along an attribute/subscript chain, outermost first: ``a.b[c].d`` -> ``["a", "b", "d"]``."""
    names: list[str] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def _is_module_write(target: ast.AST) -> bool:
    if isinstance(target, ast.Subscript):  # `x._parameters[name] = ...`; other item writes are a container's
        return isinstance(target.value, ast.Attribute) and target.value.attr in PRIVATE_DICTS
    if not isinstance(target, ast.Attribute):
        return False  # a plain name
    owners = _chain(target.value)
    if owners == ["self"] or owners == ["cls"]:
        return False  # an object's own attribute: visible in its class
    if target.attr in ("forward", "__class__"):
        return True  # `x.forward = ...` and class swaps, whatever x is called
    return any(name in MODULE_NAMES for name in owners)


def module_writes(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of every write onto a module in ``source``: attribute assignments through a module
    variable, any ``.forward =``, writes into a module's private dicts, ``__class__`` swaps, and ``setattr`` /
    ``delattr`` on a module variable."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        found += [(node.lineno, ast.unparse(t)) for t in flat if _is_module_write(t)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            first = node.args[0] if node.args else None
            chain = _chain(first) if first is not None else []
            if chain and chain != ["self"] and any(name in MODULE_NAMES for name in chain):
                found.append((node.lineno, ast.unparse(first)))
    return found


def _sources() -> list[Path]:
    return [p for sub in SCANNED for p in sorted((PACKAGE / sub).rglob("*.py")) if p != THE_ONE_PLACE]


@pytest.mark.parametrize(
    "snippet",
    [
        "module.forward = wrapped",
        "self.model.forward = wrapped",
        "target.fsdp2_config = config",
        "module.num_experts = count",
        "setattr(module, '_offset', first)",
        "setattr(self.model, 'x', 1)",
        "owner._parameters[leaf] = param",
        "m.__class__ = Other",
        "for m in model.modules():\n    m.flag = True",
        "del module.forward",
    ],
)
def test_the_scan_finds_each_kind_of_write(snippet):
    assert module_writes(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    ["self.model = model", "self.forward_count = 1", "ctx.scale = scale", "setattr(run, MARK, True)", "x = module.y"],
)
def test_the_scan_leaves_other_assignments_alone(snippet):
    assert not module_writes(snippet), snippet


def test_only_module_state_writes_onto_modules():
    unexpected, used = [], set()
    for path in _sources():
        rel = path.relative_to(PACKAGE).as_posix()
        for line, expression in module_writes(path.read_text(encoding="utf-8")):
            if (rel, expression) in ALLOWED:
                used.add((rel, expression))
            else:
                unexpected.append(f"lightning_mm/{rel}:{line}: {expression}")
    assert not unexpected, (
        "writes onto a module outside lightning_mm/core/module_state.py (give each one a named, documented "
        "function there): " + "; ".join(unexpected)
    )
    assert used == ALLOWED, f"entries of ALLOWED no longer needed: {sorted(ALLOWED - used)}"


@pytest.mark.parametrize(
    ("file", "line", "expression"),
    [
        ("core/apply.py", "module.forward = compiled_forward(module.forward, 'eager', path)", "module.forward"),
        ("core/apply.py", "target.fsdp2_config = config", "target.fsdp2_config"),
        ("core/expert_parallel.py", "module.num_experts = count", "module.num_experts"),
        ("core/expert_parallel.py", "setattr(module, '_lmm_expert_offset', first)", "module"),
        # The feature state the Hugging Face / diffusers layers keep in weak side tables now.
        ("hf/transformers_model.py", "model._pending_pretrained = pending", "model._pending_pretrained"),
        ("diffusers/model.py", "model._pending_pretrained = pending", "model._pending_pretrained"),
        ("modules/transformers_module.py", "model._pending_lora = pending", "model._pending_lora"),
        ("modules/transformers_module.py", "model._lora_config = config", "model._lora_config"),
        ("hf/chunk_loss.py", "model._chunk_loss = state", "model._chunk_loss"),
        ("hf/cp_attention.py", "decoder.config._attn_implementation = impl", "decoder.config._attn_implementation"),
        ("diffusers/wan_context_parallel.py", "wan._wan_context_parallel = handles", "wan._wan_context_parallel"),
        (
            "diffusers/wan_context_parallel.py",
            "predictor._wan_context_parallel = handles",
            "predictor._wan_context_parallel",
        ),
    ],
)
def test_the_scan_fails_when_a_write_is_added_back(file, line, expression):
    source = (PACKAGE / file).read_text(encoding="utf-8")
    assert not module_writes(source)
    readded = source + f"\n\ndef _again(module, target, config, count, first, path):\n    {line}\n"
    assert [found for _, found in module_writes(readded)] == [expression]


# ------------------------------------------------------------------------------------------------ behaviour
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_recompute_and_compile_are_recorded_listed_and_undoable():
    torch.manual_seed(0)
    model = Net()
    config = FSDP2Config(
        sub_modules_to_wrap=["layers.{*}"],
        recompute_modules=["layers.{0,1}"],
        compile_modules=["layers.1"],
        compile_backend="eager",
    )
    plan = build_plan(config, model, 1)
    x = torch.randn(2, 4, requires_grad=True)
    expected = model(x)
    apply_compile(model, plan)
    apply_recompute(model, plan)
    changes = module_state.module_changes(model)
    assert {path: [(c.attribute, c.reason) for c in cs] for path, cs in changes.items()} == {
        "layers.0": [("forward", "recompute_modules")],
        "layers.1": [("forward", "compile_modules + recompute_modules")],
    }
    listing = module_state.describe_module_changes(model)
    assert listing.splitlines()[1:] == [
        "  forward (recompute_modules): layers.0",
        "  forward (compile_modules + recompute_modules): layers.1",
    ]
    torch.testing.assert_close(model(x), expected)
    # Only `forward` was added to the instances, and deleting it gives back the class's method.
    before = {name: set(vars(Block())) for name in ("fresh",)}["fresh"]
    for i in (0, 1):
        assert set(vars(model.layers[i])) - before == {"forward"}
        del model.layers[i].forward
    assert set(vars(model.layers[2])) == before
    torch.testing.assert_close(model(x), expected)


def test_a_model_without_changes_lists_nothing():
    assert module_state.describe_module_changes(Net()) == "" and module_state.module_changes(Net()) == {}


class Experts(nn.Module):
    def __init__(self, num_experts: int = 4) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w = nn.Parameter(torch.arange(num_experts * 6, dtype=torch.float32).reshape(num_experts, 2, 3))


def test_local_experts_keep_their_offset_off_the_module():
    experts = Experts()
    full = experts.w.detach().clone()
    attributes = set(vars(experts))
    local = {"w": nn.Parameter(full[2:4].clone())}
    module_state.keep_local_experts(experts, local, first=2, count=2)
    assert experts.w is local["w"] and dict(experts.named_parameters()) == {"w": local["w"]}
    assert experts.num_experts == 2 and module_state.expert_row_offset(experts) == 2
    assert module_state.expert_row_offset(Experts()) == 0
    assert set(vars(experts)) == attributes  # no attribute of ours: the offset is kept in module_state
    reasons = {c.attribute: c.reason for c in module_state.module_changes(experts)[""]}
    assert reasons == {"parameters": "expert parallelism: experts 2..3 of w", "num_experts": reasons["num_experts"]}
    assert "2 local experts of 4" in reasons["num_experts"]


def test_move_buffer_keeps_name_and_persistence_and_refuses_other_names():
    norm = nn.BatchNorm1d(3)
    norm.register_buffer("scratch", torch.zeros(2), persistent=False)
    module_state.move_buffer(norm, "scratch", torch.ones(2))
    module_state.move_buffer(norm, "running_mean", torch.full((3,), 5.0))
    assert "scratch" not in norm.state_dict() and torch.equal(norm.state_dict()["running_mean"], torch.full((3,), 5.0))
    assert torch.equal(dict(norm.named_buffers())["scratch"], torch.ones(2))
    with pytest.raises(KeyError, match="no buffer 'weight'"):
        module_state.move_buffer(norm, "weight", torch.ones(3))


def test_a_models_own_fully_shard_gets_the_config_and_the_plan_being_applied():
    from lightning_mm.modules import FSDP2Mixin

    seen = []

    class Custom(Net, FSDP2Mixin):
        def _fully_shard(self, fsdp2_kwargs=None, fsdp2_config=None):
            seen.append((self.fsdp2_config is fsdp2_config, build_plan(fsdp2_config, self, 2)))

    model = Custom()
    config = FSDP2Config(sub_modules_to_wrap=["layers.{*}"])
    plan = build_plan(config, model, 2)
    model_unit_sharding(model, config, plan)({})
    assert seen == [(True, plan)] and seen[0][1] is plan  # the same plan object: the patterns resolved once
    assert [c.attribute for c in module_state.module_changes(model)[""]] == ["fsdp2_config"]
    # Outside the call, and for another config or model, build_plan plans afresh.
    assert build_plan(config, model, 2) is not plan and build_plan(config, model, 2) == plan
    with plan_in_use(config, model, plan):
        assert build_plan(config, model, 2) is plan
        assert build_plan(FSDP2Config(sub_modules_to_wrap=["layers.{*}"]), model, 2) is not plan
        assert build_plan(config, Net(), 2) is not plan
        assert build_plan(config, model, 1) is not plan


def test_the_ignored_modules_input_cast_is_listed():
    from lightning_mm.core.ignored import IgnoredModules

    model = Net()
    config = FSDP2Config(sub_modules_to_wrap=["layers.{0,1}"], ignored_modules=["layers.2"], param_dtype="bf16")
    IgnoredModules(model, build_plan(config, model, 1)).cast_inputs()
    assert {path: [c.attribute for c in cs] for path, cs in module_state.module_changes(model).items()} == {
        "layers.2": ["forward pre-hook"]
    }
    out = model.layers[2](torch.randn(2, 4, dtype=torch.bfloat16))  # cast to the module's own (fp32) dtype
    assert out.dtype == torch.float32
