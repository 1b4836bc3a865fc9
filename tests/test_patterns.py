"""MindSpeed MM's module-path pattern syntax, resolved strictly against a module tree."""

import pytest
from torch import nn

from lightning_mm.core.patterns import PatternError, parse_pattern, resolve_pattern


def tree() -> nn.Module:
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(10))
    root.model.norm = nn.LayerNorm(2)
    return root


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("model.norm", ["model.norm"]),
        ("model.layers.{*}", [f"model.layers.{i}" for i in range(10)]),
        ("model.layers.{0-3}", [f"model.layers.{i}" for i in range(4)]),
        ("model.layers.{1,3,5}", ["model.layers.1", "model.layers.3", "model.layers.5"]),
        ("model.layers.{0-2,7}", ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.7"]),
        ("model.layers.{ 8 - 9 }", ["model.layers.8", "model.layers.9"]),
        ("model.layers.{2}.0", ["model.layers.2.0"]),
        ("model.layers.{*}.{*}", [f"model.layers.{i}.{j}" for i in range(10) for j in range(2)]),
    ],
)
def test_expansion(pattern, expected):
    assert resolve_pattern(tree(), pattern) == expected


def test_out_of_range_index_is_an_error_with_closest_paths():
    expected = r"model.layers.{0-23}.*model.layers.10.*closest existing paths: .*model.layers"
    with pytest.raises(PatternError, match=expected):
        resolve_pattern(tree(), "model.layers.{0-23}")


def test_typo_is_an_error_with_closest_paths():
    with pytest.raises(PatternError, match=r"'model.layer'; closest existing paths: 'model.layers'"):
        resolve_pattern(tree(), "model.layer.{*}")


def test_wildcard_on_a_leaf_is_an_error():
    with pytest.raises(PatternError, match="no submodules"):
        resolve_pattern(tree(), "model.norm.{*}")


@pytest.mark.parametrize("pattern", ["a.{", "a.{}", "a.{x}", "a.{1-}", "a.b{1}", "a.{1}}", "", "a..b", "a.{3-1}"])
def test_malformed(pattern):
    with pytest.raises(PatternError):
        parse_pattern(pattern)


def test_huge_range_is_checked_against_the_model_without_being_expanded():
    from tests.helpers.limits import bounded

    with bounded(extra_bytes=512 << 20, seconds=20):
        segments = parse_pattern("model.layers.{0-999999999}")
        assert segments[-1].ranges == ((0, 999999999),)
        with pytest.raises(
            PatternError,
            match=r"'model.layers.\{0-999999999\}' resolves to no module at "
            r"'model.layers.10'",
        ):
            resolve_pattern(tree(), "model.layers.{0-999999999}")
        assert resolve_pattern(tree(), "model.layers.{8-9,0-1,8}") == [f"model.layers.{i}" for i in (8, 9, 0, 1)]


def test_pattern_errors_stay_short():
    with pytest.raises(PatternError) as err:
        parse_pattern("a.{" + "1," * 100_000 + "x}")
    assert len(str(err.value)) < 400
    with pytest.raises(PatternError, match="more than 18 digits"):
        parse_pattern("a.{" + "9" * 5000 + "}")


def _paths(root: nn.Module) -> list[str]:
    return [name for name, _ in root.named_modules()]


@pytest.mark.parametrize(
    "pattern",
    [
        "model",
        "model.norm",
        "model.layers",
        "model.layers.{*}",
        "model.layers.{0-3}",
        "model.layers.{1,3,5}",
        "model.layers.{2}.0",
        "model.layers.{*}.{*}",
        "model.layers.{*}.1",
    ],
)
def test_reading_a_pattern_agrees_with_resolving_it(pattern):
    # The default plan of a Hugging Face model filters its units by the user's ignored_modules without resolving
    # them a second time: what the strings say must be what resolution gives, for every module of the model.
    from lightning_mm._utils.modules import is_under, is_under_any
    from lightning_mm.core.patterns import names_inside, names_or_contains

    root = tree()
    resolved = resolve_pattern(root, pattern)
    for path in _paths(root):
        assert names_or_contains(pattern, path) == is_under_any(path, resolved), path
        assert names_inside(pattern, path) == any(is_under(r, path) for r in resolved), path


def test_reading_an_index_pattern_names_only_the_items_resolution_names():
    from lightning_mm.core.patterns import names_or_contains

    root = nn.Module()
    root.blocks = nn.ModuleDict({"03": nn.Linear(1, 1), "3": nn.Linear(1, 1), "x": nn.Linear(1, 1)})
    assert resolve_pattern(root, "blocks.{3}") == ["blocks.3"]
    assert [p for p in _paths(root) if names_or_contains("blocks.{3}", p)] == ["blocks.3"]
    assert not names_or_contains("blocks.{", "blocks.3")  # malformed: no match (the plan reports it)


def mixed_tree() -> nn.Module:
    """Qwen3.5's layout: gated-delta-net layers (``linear_attn``) between full-attention layers (``self_attn``)."""
    root = nn.Module()
    root.layers = nn.ModuleList()
    for kind in ("linear_attn", "linear_attn", "self_attn", "linear_attn"):
        layer = nn.Module()
        setattr(layer, kind, nn.Linear(2, 2))
        layer.mlp = nn.Linear(2, 2)
        root.layers.append(layer)
    return root


def test_a_suffix_present_in_some_layers_names_those_layers_as_mindspeed_mm_does():
    """MindSpeed MM matches a pattern against ``named_modules()`` (``fully_shard_parallel.get_fsdp_modules``): a
    ``{*}`` pattern whose suffix exists in only some layers names the modules of those layers."""
    root = mixed_tree()
    # the re-telling: every named module whose dotted name matches the pattern segment by segment
    expected = [
        name
        for name, _ in root.named_modules()
        if len(name.split(".")) == 3 and name.startswith("layers.") and name.endswith(".linear_attn")
    ]
    assert (
        resolve_pattern(root, "layers.{*}.linear_attn")
        == expected
        == [
            "layers.0.linear_attn",
            "layers.1.linear_attn",
            "layers.3.linear_attn",
        ]
    )
    assert resolve_pattern(root, "layers.{1-2}.self_attn") == ["layers.2.self_attn"]


def test_a_pattern_that_names_nothing_at_all_stays_an_error():
    with pytest.raises(PatternError, match=r"'layers.0.cross_attn'; closest existing paths"):
        resolve_pattern(mixed_tree(), "layers.{*}.cross_attn")
    with pytest.raises(PatternError, match="no submodules"):
        resolve_pattern(mixed_tree(), "layers.{*}.mlp.{*}")
