"""Per-block torch.compile (`compile_modules`): the plan, its errors, inductor's numerics, and 2 ranks of FSDP2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from lightning_mm.core.apply import apply_compile, apply_recompute
from lightning_mm.core.compile import CompileError
from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.core.sharding_plan import build_plan

ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # data-dependent control flow: not one graph
            return x * 2
        return x


def _plan(model: nn.Module, world_size: int = 1, **config):
    return build_plan(FSDP2Config.from_dict({"sharding_size": world_size, **config}), model, world_size)


def test_plan_resolves_compile_modules_and_says_what_is_compiled():
    plan = _plan(Custom(), sub_modules_to_wrap=["inner.{*}"], compile_modules=["inner.{*}"], compile_backend="eager")
    assert plan.compile_modules == ("inner.0", "inner.1") and plan.compile_backend == "eager"
    assert "compiled (torch.compile, backend eager, one graph each; the rest eager): inner.0, inner.1" in (
        plan.describe()
    )
    assert "compiled" not in _plan(Custom()).describe()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"sub_modules_to_wrap": ["inner.{*}"], "compile_modules": ["inner"]}, "'inner' holds FSDP units"),
        ({"compile_modules": ["inner", "inner.0"]}, "'inner.0' is inside 'inner'"),
        ({"compile_modules": ["inner.{0-5}"]}, "compile_modules"),
    ],
)
def test_compile_modules_that_cannot_work_are_errors_before_training(config, message):
    with pytest.raises((FSDP2ConfigError, ValueError), match=message):
        _plan(Custom(), **config)


def test_an_unknown_backend_names_the_key():
    with pytest.raises(FSDP2ConfigError, match="`compile_backend`.*unknown torch.compile backend 'nope'"):
        FSDP2Config.from_dict({"compile_modules": ["x"], "compile_backend": "nope"})


def test_a_block_that_is_not_one_graph_is_an_error_naming_it_not_an_eager_run():
    model = nn.Sequential(Branchy())
    apply_compile(model, _plan(model, compile_modules=["0"], compile_backend="aot_eager"))
    with pytest.raises(CompileError, match="`compile_modules`: '0' cannot be compiled as one graph"):
        model(torch.ones(2))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.multiprocess  # inductor compiles its kernels with g++ in subprocesses
def test_inductor_matches_eager_for_a_transformers_and_a_custom_model():
    """Inductor fuses and reorders the float operations of each block (its reductions and GELU/SiLU
    approximations are computed in another order than eager's kernels), so fp32 results differ in the last bits
    only: a relative 1e-4 (about 10^3 ulp of fp32) with an absolute floor of 1e-6 for values near zero is tight
    enough to catch any wrong graph (a dropped residual or a wrong layer changes them by 1e-2 or more) and loose
    enough for rounding. Recomputation wraps the compiled forward (the non-reentrant implementation here; the
    2-rank test covers both)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        use_cache=False,
    )
    ids = torch.randint(0, 64, (2, 12))
    for build, run in (
        (lambda: transformers.Qwen3ForCausalLM(cfg), lambda m: m(input_ids=ids, labels=ids).loss),
        (Custom, lambda m: m(torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))).sum()),
    ):
        torch.manual_seed(1)
        eager, compiled = build(), build()
        compiled.load_state_dict(eager.state_dict())
        blocks = "model.layers.{*}" if isinstance(eager, transformers.PreTrainedModel) else "inner.{*}"
        plan = _plan(compiled, compile_modules=[blocks], recompute_modules=[blocks], use_reentrant=False)
        apply_compile(compiled, plan)
        apply_recompute(compiled, plan)
        loss_eager, loss_compiled = run(eager), run(compiled)
        loss_eager.backward()
        loss_compiled.backward()
        torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-4, atol=1e-6)
        _close(_grads(compiled), _grads(eager), rtol=1e-4, atol=1e-6)


def test_two_ranks_compiled_blocks_train_like_plain_transformers_with_a_bounded_number_of_graphs(tmp_path):
    sys.path.insert(0, str(ROOT))
    from tests.helpers import scenario_kit
    from tests.scenarios import compile_scenarios
    from tests.scenarios.compile_scenarios import write_model

    write_model(tmp_path / "qwen3")
    write_model(tmp_path / "qwen3_moe", moe=True)
    args = {"model_dir": tmp_path / "qwen3", "moe_dir": tmp_path / "qwen3_moe"}
    scenario_kit.run(compile_scenarios.compile_runs, tmp_path / "out", args=args, timeout=900)
    ranks = scenario_kit.read_results(tmp_path / "out", "compile")
    reference = torch.tensor(ranks[0]["reference"])
    for name, expected in (
        ("compiled", reference),
        ("compiled_reentrant", reference),
        ("moe_ep2_compiled_attention", torch.tensor(ranks[0]["moe_reference"])),
    ):
        # data parallel: the global loss is the ranks' mean
        losses = torch.tensor([(a + b) / 2 for a, b in zip(ranks[0][name]["losses"], ranks[1][name]["losses"])])
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0, msg=name)
    for rank in ranks:  # CP 2: both ranks hold the same samples and report the whole sequences' loss
        torch.testing.assert_close(torch.tensor(rank["compiled_cp2"]["losses"]), reference, rtol=1e-5, atol=0)
    # LoRA on bf16 parameters with an ignored embedding: the compiled blocks compute what the eager ones do (the
    # captured graph runs the same bf16 kernels; 1e-3 leaves room for a reordered bf16 rounding).
    for rank in ranks:
        torch.testing.assert_close(
            torch.tensor(rank["lora_bf16_compiled"]["losses"]),
            torch.tensor(rank["lora_bf16_eager"]["losses"]),
            rtol=1e-3,
            atol=0,
        )
    # Four sequence lengths, two layers: one static and one dynamic graph for all of them (twice that with the
    # reentrant recomputation, whose first pass runs without gradients).
    assert [r["compiled"]["graphs"] for r in ranks] == [2, 2]
    assert [r["compiled_reentrant"]["graphs"] for r in ranks] == [4, 4]
    assert [r["lora_bf16_eager"]["graphs"] for r in ranks] == [0, 0]
    assert all(r["moe_ep2_compiled_attention"]["graphs"] >= 1 for r in ranks)
