"""Ulysses context parallelism: the plan and its errors in-process; training on 2 and 4 real gloo ranks against the
same model without context parallelism and against a one-process Transformers model
(``tests/scenarios/cp_scenarios.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.packing_families import tiny_packing_model
from tests.helpers.parity import LR, NOISE, Reference, weight_errors
from tests.helpers.scenario_kit import run
from tests.scenarios import cp_scenarios
from tests.scenarios.cp_scenarios import (
    BAD_CASE,
    CASES,
    FOUR_RANK_CASES,
    RESUME_CASES,
    TWO_RANK_CASES,
    CPCase,
    TinyAttentionLM,
    batch_of,
)
from tests.scenarios.hf_scenarios import save_tiny_checkpoints, tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
WEIGHT_TOL = 2e-4
"""Weights after several AdamW steps: Adam divides each gradient element by its own running size, which magnifies
the rounding of small elements. The one-process reference itself, fed the same samples one at a time instead of
two at a time (the same sums in another order), moves Qwen2.5-VL's key biases and LM head by up to 2.7e-5. On an
AMD EPYC host the 4-rank HSDP case measured 1.42e-4 on the vision tower's first ``mlp.up_proj.bias``, all but
1.1e-5 of it from one element whose first gradient is 5.6e-6 of the step's largest (its weight differs by 8.5e-6
of 8.2e-3); losses and gradients, compared before Adam, stay within ``TOL``. A wrong optimiser state or gradient
scale moves weights by 1e-2 and more."""


# ------------------------------------------------------------------------------------- in-process: deciding
def test_plan_layout_and_description() -> None:
    from lightning_mm.core.context_parallel import context_parallel_plan

    plan = context_parallel_plan(8, 2, "ulysses_cp_algo")
    assert plan.algo == "ulysses" and plan.mesh_shape == (4, 2) and plan.mesh_dim_names == ("dp", "cp")
    assert plan.groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [plan.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (plan.padded_length(15), plan.local_length(15)) == (16, 8)
    text = plan.describe(seq_len=15, activation_bytes=2**30)
    assert "mesh (dp=4 x cp=2)" in text and "15 tokens -> 8 per rank (1 padding)" in text
    assert "546.1 MiB" in text and "1,024.0 MiB" in text  # 1 GiB x 8 / 15 per rank


@pytest.mark.parametrize(
    "world,size,algo,message",
    [
        (6, 4, "ulysses", "does not divide the world size 6"),
        (4, 2, "ring", "'ring' is not supported"),
        (4, 0, "ulysses", "must be a positive integer"),
    ],
)
def test_bad_settings(world: int, size: int, algo: str, message: str) -> None:
    from lightning_mm.core.context_parallel import ContextParallelError, context_parallel_plan

    with pytest.raises(ContextParallelError, match=message):
        context_parallel_plan(world, size, algo)


def test_strategy_refuses_a_bad_algorithm_at_construction() -> None:
    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.core.context_parallel import ContextParallelError

    with pytest.raises(ContextParallelError, match="not supported"):
        MMFSDP2Strategy(context_parallel_algo="ring")
    assert MMFSDP2Strategy(context_parallel_size=2).context_parallel_size == 2
    # the argument as given (None: the YAML decides), which `lightning-mm plan` passes on to the layout
    assert MMFSDP2Strategy(context_parallel_size=2).requested_context_parallel_algo is None
    given = MMFSDP2Strategy(context_parallel_size=2, context_parallel_algo="megatron_cp_algo")
    assert (given.requested_context_parallel_algo, given.context_parallel_algo) == ("megatron_cp_algo", "kv_allgather")


def test_zigzag_layout_balances_causal_work() -> None:
    """Rank ``r`` holds chunks ``r`` and ``2C-1-r`` of ``2C`` (MindSpeed MM's load_balanced_split,
    mindspeed_mm/fsdp/distributed/context_parallel/communication.py): together the ranks hold every position once,
    each the same number of tokens and of causal (query, key) pairs."""
    from lightning_mm.core.ring_attention import zigzag_causal_mask, zigzag_index, zigzag_padded_length

    assert zigzag_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for size in (2, 3, 4):
        padded = zigzag_padded_length(15, size)
        assert padded % (2 * size) == 0 and padded - 15 < 2 * size
        held = [zigzag_index(padded, size, r) for r in range(size)]
        assert sorted(torch.cat(held).tolist()) == list(range(padded))
        assert len({len(h) for h in held}) == 1
        pairs = [int(zigzag_causal_mask(h, padded).sum()) for h in held]
        assert len(set(pairs)) == 1, pairs  # the contiguous split would give rank 0 the fewest pairs
    segments = torch.tensor([[0] * 5 + [1] * 3])  # a packed row: block-diagonal and causal
    mask = zigzag_causal_mask(zigzag_index(8, 2, 0), 8, segments=segments)[0, 0]
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert mask[1].tolist() == [True] * 2 + [False] * 6  # position 1 (sample 0) sees positions 0 and 1
    assert mask[2].tolist() == [False] * 5 + [True, True, False]  # position 6 (sample 1) sees 5 and 6
    assert mask[3].tolist() == [False] * 5 + [True] * 3


def test_zigzag_chunks_attend_without_a_dense_mask() -> None:
    """Each zig-zag chunk over its prefix of the keys, lower-right causal (no dense mask), equals the rank's rows of
    whole-sequence causal attention, values and gradients (grouped-query heads repeated), for every rank."""
    from lightning_mm.core.ring_attention import zigzag_causal_sdpa, zigzag_index

    g = torch.Generator().manual_seed(0)
    size, local = 3, 4
    padded = 2 * size * local
    q = torch.randn(2, 4, padded, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, padded, 8, generator=g, requires_grad=True) for _ in range(2))
    whole = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.3
    )
    weights = torch.randn(whole.shape, generator=g)
    expected = torch.autograd.grad((whole * weights).sum(), (q, k, v))
    got = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(size):
        index = zigzag_index(padded, size, rank)
        out = zigzag_causal_sdpa(q[:, :, index], k, v, rank, size, scale=0.3)
        torch.testing.assert_close(out, whole[:, :, index], rtol=1e-5, atol=1e-6)
        for acc, grad in zip(got, torch.autograd.grad((out * weights[:, :, index]).sum(), (q, k, v))):
            acc += grad
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_algorithm_names_and_the_yaml_key() -> None:
    """MindSpeed MM's names (``--context-parallel-algo``; mindspeed_mm/models/common/mm_gpt_model.py) select the
    algorithm; the FSDP2 YAML key ``context_parallel_algo`` and the strategy argument are one setting."""
    from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
    from lightning_mm.core.context_parallel import ContextParallelError, context_parallel_plan
    from lightning_mm.core.parallel_layout import config_layout

    plan = context_parallel_plan(4, 2, "megatron_cp_algo")
    assert plan.algo == "kv_allgather" and (plan.padded_length(15), plan.local_length(15)) == (16, 8)
    assert context_parallel_plan(4, 2, "kvallgather_cp_algo").algo == "kv_allgather"
    assert "rank r holds chunks r and 3-r" in plan.describe(seq_len=15)
    with pytest.raises(ContextParallelError, match="'hybrid_cp_algo' .Ulysses inside ring attention. is not"):
        context_parallel_plan(4, 2, "hybrid_cp_algo")
    config = FSDP2Config.from_dict({"context_parallel_size": 2, "context_parallel_algo": "megatron_cp_algo"})
    assert config.context_parallel_algo == "kv_allgather"
    layout = config_layout(config, 4)
    assert (layout.cp, layout.cp_algo) == (2, "kv_allgather") and "context_parallel_size 2 (kv_allgather)" in (
        layout.describe()
    )
    assert config_layout(config, 4, None, "megatron_cp_algo").cp_algo == "kv_allgather"
    with pytest.raises(FSDP2ConfigError, match="`context_parallel_algo`: kv_allgather, but the strategy was given"):
        config_layout(config, 4, None, "ulysses")
    assert config_layout(FSDP2Config.from_dict({"context_parallel_size": 2}), 4, None, "kv_allgather").cp_algo == (
        "kv_allgather"
    )
    with pytest.raises(FSDP2ConfigError, match="`context_parallel_algo`: 'ring' is not supported"):
        FSDP2Config.from_dict({"context_parallel_algo": "ring"})


def test_kv_allgather_takes_any_head_count_and_refuses_what_it_cannot_mask() -> None:
    from lightning_mm.core.context_parallel import ContextParallelError
    from lightning_mm.hf.cp_attention import check_routable

    model = cp_scenarios.tiny_qwen3_3heads()
    with pytest.raises(ContextParallelError, match="3 attention heads do not divide by context_parallel_size 2"):
        check_routable(model, 2)
    assert check_routable(model, 2, "kv_allgather") is model.model
    assert check_routable(model, 3, "kv_allgather") is model.model
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(
        ContextParallelError, match="'flash_attention_2' cannot be routed through context_parallel_algo"
    ):
        check_routable(model, 2, "kv_allgather")
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(
        ContextParallelError, match=r"kv_allgather masks full causal attention only.*'sliding_attention'"
    ):
        check_routable(model, 2, "kv_allgather")


def test_heads_and_routing_errors() -> None:
    from lightning_mm.core.context_parallel import ContextParallelError
    from lightning_mm.hf.cp_attention import check_routable
    from lightning_mm.strategies.cp_setup import ContextParallelSetup

    model = tiny_hf_model("qwen3")  # 4 heads, 2 key/value heads
    assert check_routable(model, 2) is model.model
    with pytest.raises(ContextParallelError, match="2 key/value heads do not divide by context_parallel_size 4"):
        check_routable(model, 4)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ContextParallelError, match="'flash_attention_2' cannot be routed"):
        check_routable(model, 2)
    from lightning_mm.core.context_parallel import context_parallel_plan

    setup = ContextParallelSetup(2, "ulysses")
    setup.plan = context_parallel_plan(2, 2)  # what setup() decides; its mesh needs processes
    with pytest.raises(ContextParallelError, match="cannot be routed .no Transformers model"):
        setup.apply(torch.nn.Module(), torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------------------- distributed runs


@pytest.fixture(scope="module")
def ckptdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cp_ckpt")
    save_tiny_checkpoints(directory, ["qwen3", "qwen2_5_vl", "internvl"])
    tiny_packing_model("qwen3_5", seed=3).save_pretrained(directory / "qwen3_5")
    cp_scenarios.tiny_qwen3_3heads().save_pretrained(directory / cp_scenarios.QWEN3_3HEADS)
    return directory


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, ckptdir: Path) -> Path:
    out = tmp_path_factory.mktemp("cp_two")
    run(cp_scenarios.two, out, args={"ckptdir": ckptdir}, timeout=420)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, ckptdir: Path) -> Path:
    out = tmp_path_factory.mktemp("cp_four")
    run(cp_scenarios.four, out, args={"ckptdir": ckptdir}, timeout=420)
    return out


def _ranks(out: Path, name: str, world: int) -> list[dict[str, Any]]:
    ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]
    assert all(r["error"] is None for r in ranks), ranks[0]["error"]
    return ranks


def _global_steps(ranks: list[dict[str, Any]], part: int, cp: int) -> tuple[list[list[list[int]]], list[float]]:
    """Per step, the samples of each data-parallel group; per step, the loss (mean over the groups).

    The ranks of one context-parallel group must have seen the same samples and report the same loss.
    """
    records = [r["parts"][part] for r in ranks]
    for first in range(0, len(records), cp):
        for other in records[first + 1 : first + cp]:
            assert other["indices"] == records[first]["indices"]
            assert other["losses"] == records[first]["losses"]
    leaders = records[::cp]
    steps = [list(group) for group in zip(*(r["indices"] for r in leaders))]
    losses = [sum(v) / len(v) for v in zip(*(r["losses"] for r in leaders))]
    return steps, losses


def tiny_packing_model_arch(family: str) -> str | None:
    """The architecture of a ``tests/helpers/packing_families.py`` family, or ``None``."""
    from tests.helpers.packing_families import FAMILIES as PACKING

    return type(tiny_packing_model(family)).__name__ if family in PACKING else None


def _reference(
    case: CPCase,
    steps: list[list[list[int]]],
    ckptdir: Path,
    initial: Path | None = None,
) -> tuple[Reference, list[float], dict[str, torch.Tensor]]:
    """Plain Transformers in one process: per step, the mean over the data-parallel groups of their losses."""
    import transformers

    from tests.scenarios.hf_scenarios import FAMILIES

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        if case.custom:  # the strategy's initial weights, in one plain process
            model = TinyAttentionLM()
            model.load_state_dict(torch.load(initial))
        elif case.family == cp_scenarios.QWEN3_3HEADS:
            model = transformers.Qwen3ForCausalLM.from_pretrained(str(ckptdir / case.family), dtype=torch.float32)
        else:
            arch = tiny_packing_model_arch(case.family) or FAMILIES[case.family][0]
            model = getattr(transformers, arch).from_pretrained(str(ckptdir / case.family), dtype=torch.float32)
        model.train()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        small = {n: torch.ones_like(p, dtype=torch.bool) for n, p in named}
        moved = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in named}
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        losses: list[float] = []
        first_grads: dict[str, torch.Tensor] = {}
        for groups in steps:
            values = []
            for indices in groups:
                if case.packed:  # the packed row's loss: its samples run alone, token losses summed
                    loss = _unpacked_loss(model, case, indices)
                else:
                    out = model(**batch_of(case, indices))
                    loss = out if isinstance(out, torch.Tensor) else out.loss
                grads = torch.autograd.grad(loss / len(groups), params, allow_unused=True)
                values.append(float(loss.detach()))
                for p, g in zip(params, grads):
                    if g is not None:
                        p.grad = g if p.grad is None else p.grad + g
            losses.append(sum(values) / len(values))
            if not first_grads:
                first_grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
            largest = max(float(p.grad.abs().max()) for p in params if p.grad is not None)
            for n, p in named:
                if p.grad is not None:
                    small[n] &= p.grad.abs() <= NOISE * largest
                    moved[n] |= p.grad != 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        final = {k: v.detach().clone() for k, v in model.named_parameters()}
        noise = {n: small[n] & moved[n] for n in small}
        return Reference(losses, final, {n: m for n, m in noise.items() if m.any()}), losses, first_grads
    finally:
        torch.set_num_threads(threads)


def _unpacked_loss(model: torch.nn.Module, case: CPCase, indices: list[int]) -> torch.Tensor:
    """The mean token loss over ``indices``' samples, each run alone (no packing, no mask): the loss a packed row of
    them must have."""
    total, count = torch.zeros(()), 0
    for i in indices:
        sample = batch_of(case, [i])
        sample.pop("attention_mask", None)
        n = int((sample["labels"][:, 1:] != -100).sum())
        total = total + model(**sample).loss * n
        count += n
    return total / count


def _grad_errors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, the gradient difference relative to the step's largest gradient norm."""
    assert set(actual) == set(expected)
    scale = max(float(g.norm()) for g in expected.values())
    return {n: float((actual[n] - expected[n]).norm()) / max(float(expected[n].norm()), 1e-3 * scale) for n in expected}


def _check_against_reference(out: Path, case: CPCase, world: int, ckptdir: Path) -> None:
    ranks = _ranks(out, case.name, world)
    cps = [case.cp] if case.resume_at is None else [case.cp, case.resume_cp]
    steps, losses = [], []
    for part, cp in enumerate(cps):
        s, lo = _global_steps(ranks, part, cp)
        steps += s
        losses += lo
    assert len(steps) == case.steps
    ref, ref_losses, ref_grads = _reference(case, steps, ckptdir, out / f"{case.name}.init.pt")
    loss_err = [abs(a - e) / abs(e) for a, e in zip(losses, ref_losses)]
    assert max(loss_err) < TOL, (losses, ref_losses)
    grad_err = _grad_errors(torch.load(out / f"{case.name}.grad.pt"), ref_grads)
    assert max(grad_err.values()) < TOL, sorted(grad_err.items(), key=lambda kv: -kv[1])[:3]
    weight_err = weight_errors(torch.load(out / f"{case.name}.pt"), ref)
    assert max(weight_err.values()) < WEIGHT_TOL, sorted(weight_err.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("name", [c.name for c in [*TWO_RANK_CASES, *RESUME_CASES]])
def test_two_ranks_match_reference(two: Path, ckptdir: Path, name: str) -> None:
    _check_against_reference(two, CASES[name], 2, ckptdir)


def test_kv_allgather_ranks_hold_their_zigzag_chunks(two: Path) -> None:
    """Each rank's decoder sees the positions of chunks ``r`` and ``2C-1-r`` (MindSpeed MM's load-balanced split),
    as many tokens on every rank, every step; the end padding (position 0) falls in rank 0's last chunk."""
    expected = {
        # 15 tokens -> 16, chunks of 4: rank 0 chunks 0 and 3, rank 1 chunks 1 and 2 (both rows of the batch)
        "qwen3h3-ring-cp2-len15-padding-mask": ([0, 1, 2, 3, 12, 13, 14, 0], [4, 5, 6, 7, 8, 9, 10, 11]),
        # two packed samples of 15 (positions restart) -> 32, chunks of 8
        "qwen3h3-ring-cp2-packed": (
            [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 0, 0],
            [8, 9, 10, 11, 12, 13, 14, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        ),
        # 13 tokens -> 16; M-RoPE's 3 rows of positions split alike
        "qwen2_5_vl-ring-cp2-len13": ([0, 1, 2, 3, 12, 0, 0, 0], [4, 5, 6, 7, 8, 9, 10, 11]),
    }
    for name, per_rank in expected.items():
        ranks = _ranks(two, name, 2)
        for rank, want in zip(ranks, per_rank):
            seen = [torch.tensor(p) for p in rank["parts"][0]["positions"]]
            assert len(seen) == CASES[name].steps
            for positions in seen:
                rows = positions.reshape(-1, positions.shape[-1])
                assert all(row.tolist() == want for row in rows), (name, rows.tolist(), want)


def test_context_parallel_equals_no_context_parallel(two: Path) -> None:
    cp, plain = "qwen3-cp2-len16", "qwen3-nocp-len16"
    _, cp_losses = _global_steps(_ranks(two, cp, 2), 0, 2)
    _, plain_losses = _global_steps(_ranks(two, plain, 2), 0, 1)
    assert max(abs(a - b) / abs(b) for a, b in zip(cp_losses, plain_losses)) < TOL
    for kind, tol in (("grad.pt", TOL), ("pt", WEIGHT_TOL)):
        a, b = torch.load(two / f"{cp}.{kind}"), torch.load(two / f"{plain}.{kind}")
        errors = {n: float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)) for n in b}
        assert max(errors.values()) < tol, (kind, sorted(errors.items(), key=lambda kv: -kv[1])[:3])


def test_logged_loss_is_the_global_loss(two: Path, four: Path) -> None:
    """``train/loss`` (synchronised over all ranks) is the loss of the global batch: the ranks of a
    context-parallel group each hold the whole-sequence loss, so the mean over ranks counts each sample once."""
    for out, name, world in ((two, "qwen3-cp2-len15", 2), (four, "qwen3-dp2xcp2-len15-recompute", 4)):
        ranks = _ranks(out, name, world)
        _, losses = _global_steps(ranks, 0, CASES[name].cp)
        assert ranks[0]["metrics"]["train/loss"] == pytest.approx(losses[-1], rel=1e-6)


def test_predict_is_refused_before_any_batch(two: Path) -> None:
    """Prediction would return each rank's slice of the sequence: an error at setup, on every rank."""
    errors = [json.loads((two / f"predict-cp2.rank{r}.json").read_text())["error"] for r in range(2)]
    assert all(e and "ContextParallelError" in e and "trainer.predict would return" in e for e in errors), errors


def test_throughput_counts_each_sample_once(four: Path) -> None:
    """The 2 ranks of a context-parallel group share their samples: global rates are the per-device rates times
    the 2 data-parallel ranks, not times the world size 4."""
    rates = _ranks(four, "qwen3-dp2xcp2-len15-recompute", 4)[0]["throughput"]
    assert rates["samples_per_sec"] == pytest.approx(2 * rates["device/samples_per_sec"])
    assert rates["items_per_sec"] == pytest.approx(2 * rates["device/items_per_sec"])
    # The FLOP meter (tests/test_flops.py): each rank of a group is counted half of its group's batch, so the global
    # token rate is the per-device one times the world size 4; the recomputed layers add hardware FLOPs only.
    assert rates["tokens_per_sec"] == pytest.approx(4 * rates["device/tokens_per_sec"])
    assert rates["hardware_tflops_per_device"] > rates["tflops_per_device"] > 0


@pytest.mark.parametrize("name", [c.name for c in FOUR_RANK_CASES])
def test_four_ranks_dp2_cp2_match_reference(four: Path, ckptdir: Path, name: str) -> None:
    _check_against_reference(four, CASES[name], 4, ckptdir)


def test_heads_not_dividing_fail_at_setup(four: Path) -> None:
    errors = [json.loads((four / f"{BAD_CASE.name}.rank{r}.json").read_text())["error"] for r in range(4)]
    assert all(e and "2 key/value heads do not divide by context_parallel_size 4" in e for e in errors), errors


def test_migrate_maps_the_megatron_flags() -> None:
    from lightning_mm.mindspeed.launch_script import parse_script
    from lightning_mm.mindspeed.megatron_route import migrate

    launch = parse_script(
        "torchrun --nproc_per_node 8 pretrain_vlm.py --use-torch-fsdp2 --micro-batch-size 1 "
        "--global-batch-size 8 --context-parallel-size 2 --context-parallel-algo ulysses_cp_algo"
    )
    result = migrate(launch)
    args = result.config["trainer"]["strategy"]["init_args"]
    assert (args["context_parallel_size"], args["context_parallel_algo"]) == (2, "ulysses")
    assert result.config["trainer"]["accumulate_grad_batches"] == 2  # 8 / (1 x 4 data-parallel ranks)
    ring = migrate(parse_script("torchrun pretrain_vlm.py --context-parallel-algo megatron_cp_algo"))
    assert ring.config["trainer"]["strategy"]["init_args"]["context_parallel_algo"] == "kv_allgather"
    hybrid = migrate(parse_script("torchrun pretrain_vlm.py --context-parallel-algo hybrid_cp_algo"))
    assert any("'hybrid_cp_algo' (Ulysses inside ring attention) is not supported" in u for u in hybrid.unmapped)
    assert "context_parallel_algo" not in str(hybrid.config)


def test_native_ring_attention_size_maps_to_kv_allgather() -> None:
    """MindSpeed MM's native ``parallel.ring_attention_size`` (ring attention, NPU-only there;
    mindspeed_mm/fsdp/params/parallel_args.py) is context parallelism with ``kv_allgather`` here; together with
    ``ulysses_parallel_size`` (hybrid) it is refused naming both keys."""
    from lightning_mm.core.config import FSDP2ConfigError
    from lightning_mm.mindspeed.load import fsdp2_config

    config = fsdp2_config({"fully_shard_parallel_size": "auto", "ring_attention_size": 2})
    assert (config.context_parallel_size, config.context_parallel_algo) == (2, "kv_allgather")
    with pytest.raises(FSDP2ConfigError, match="ring_attention_size: 2 with ulysses_parallel_size 2: hybrid"):
        fsdp2_config({"ring_attention_size": 2, "ulysses_parallel_size": 2})


def _plan_config(tmp_path: Path, cp: int, provider: str = "qwen3_provider") -> Path:
    path = tmp_path / f"cp{cp}-{provider}.yaml"
    path.write_text(f"""
trainer:
  accelerator: cpu
  devices: 4
  strategy:
    class_path: lightning_mm.MMFSDP2Strategy
    init_args:
      context_parallel_size: {cp}
model:
  class_path: lightning_mm.MMLightningModule
  init_args:
    model_provider: tests.scenarios.cp_scenarios.{provider}
data:
  class_path: lightning_mm.MMDataModule
  init_args:
    train_valid_test_datasets_provider: tests.scenarios.cp_scenarios.qwen3_datasets
""")
    return path


def test_lightning_mm_plan_shows_the_kv_allgather_layout(tmp_path: Path) -> None:
    """``lightning-mm plan`` with ``context_parallel_algo: megatron_cp_algo`` in the FSDP2 YAML: a model with 3 heads
    plans at CP 2 and CP 4 (Ulysses refuses both), the zig-zag layout and the padding to ``2C`` are shown."""
    from lightning_mm.commands.plan_command import plan_from_cli_config

    path = _plan_config(tmp_path, 4, "qwen3_3heads_provider")
    text = path.read_text().replace(
        "      context_parallel_size: 4\n",
        "      fsdp2_config: {sharding_size: auto, context_parallel_size: 4, "
        "context_parallel_algo: megatron_cp_algo}\n",
    )
    path.write_text(text)
    text = plan_from_cli_config(["--config", str(path)], seq_length=4095)
    assert "context parallel: kv_allgather, mesh (dp=1 x cp=4)" in text
    assert "rank r holds chunks r and 7-r" in text and "sequence 4095 tokens -> 1024 per rank (1 padding)" in text


def test_lightning_mm_plan_shows_the_cp_mesh_and_activations_per_rank(tmp_path: Path) -> None:
    from lightning_mm.commands.plan_command import plan_from_cli_config
    from lightning_mm.core.context_parallel import ContextParallelError

    text = plan_from_cli_config(["--config", str(_plan_config(tmp_path, 2))], seq_length=4096)
    assert "FSDP, world size 4" in text
    assert "context parallel: ulysses, mesh (dp=2 x cp=2); groups sharing samples: [0,1], [2,3]" in text
    assert "sequence 4096 tokens -> 2048 per rank" in text
    # 34 x 4096 x 32 hidden x 2 layers 16-bit bytes = 8.5 MiB, halved
    assert "decoder activations per rank ~ 4.2 MiB (without context parallel 8.5 MiB; 1/2)" in text
    with pytest.raises(ContextParallelError, match="2 key/value heads do not divide by context_parallel_size 4"):
        plan_from_cli_config(["--config", str(_plan_config(tmp_path, 4))])


def test_gated_deltanet_models_are_accepted_other_stateful_layers_refused(tmp_path: Path) -> None:
    """Qwen3.5's / Qwen3-Next's Gated DeltaNet runs on the whole sequence gathered over the group (exactness:
    tests/test_packing.py::test_two_rank_fsdp2_packed_qwen3_5_equals_plain_transformers): ``lightning-mm plan`` and
    the routing check accept them; layers with other sequence state (Mamba, ...) are still refused by class and
    path before any step."""
    from lightning_mm.commands.plan_command import plan_from_cli_config
    from lightning_mm.core.context_parallel import ContextParallelError
    from lightning_mm.hf.cp_attention import check_routable
    from lightning_mm.hf.packed_inputs import install_packed_inputs
    from tests.test_packing import _meta

    assert "mesh (dp=2 x cp=2)" in plan_from_cli_config(
        ["--config", str(_plan_config(tmp_path, 2, "qwen3_5_provider"))]
    )
    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        model = tiny_packing_model(family)
        install_packed_inputs(model)
        assert check_routable(model, 2) is model.get_decoder()
    refused = {
        "BambaForCausalLM": r"model\.layers\.0\.mamba \(BambaMixer\) carries state along the sequence",
        "FalconH1ForCausalLM": r"model\.layers\.0 \(FalconH1DecoderLayer\) is of kind 'hybrid'",
        "MiniMaxForCausalLM": r"model\.layers\.1\.self_attn \(MiniMaxLightningAttention\) carries state",
    }
    for arch, message in refused.items():
        with pytest.raises(ContextParallelError, match=message + ".*context_parallel_size 1"):
            check_routable(_meta(arch), 2)
    dense = tiny_hf_model("qwen3")
    assert check_routable(dense, 2) is dense.model
    assert "mesh (dp=2 x cp=2)" in plan_from_cli_config(["--config", str(_plan_config(tmp_path, 2))])
