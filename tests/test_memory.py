"""Guard: exact per-rank byte accounting of parameters, gradients and optimiser state (no timing).

The computed accounting alone (no processes), and once what two real ranks hold after sharding and a step.
"""

import pytest
import torch
from torch import nn

from lightning_mm import FSDP2Config
from lightning_mm.core.memory import local_numel, per_rank_memory
from lightning_mm.core.sharding_plan import build_plan


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)  # 64,000
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))  # 3 x (4,096 + 64)
        self.vision = nn.Linear(64, 63)  # 4,032 + 63, ignored (kept whole)
        self.head = nn.Linear(64, 1001, bias=False)  # 64,064: 1001 rows do not split evenly
        self.vision.requires_grad_(False)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_exact_bytes_per_rank(world):
    model = Small()
    plan = build_plan(
        FSDP2Config(sharding_size="auto", sub_modules_to_wrap=["layers.{*}", "head"], ignored_modules=["vision"]),
        model,
        world,
    )
    memory = per_rank_memory(model, plan)
    rows = lambda n: -(-n // world)  # noqa: E731  ceil
    sharded = (rows(1000) * 64 + 3 * (rows(64) * 64 + rows(64)) + rows(1001) * 64) * 4
    ignored = (4032 + 63) * 4
    assert memory.params == sharded + ignored
    assert memory.grads == sharded  # the ignored vision layer is frozen
    assert memory.optimizer == 2 * sharded
    full = (64000 + 3 * 4160 + 64064) * 4
    assert memory.ddp_params == full + ignored and memory.ddp_grads == full
    # Sharding target of the benchmarks: at most 1/N of DDP plus 1% (here the frozen ignored layer is the 1%).
    assert memory.total <= memory.ddp_total / world * 1.01 + ignored


def test_uneven_rows_use_the_largest_shard():
    assert local_numel((1001, 64), 2) == 501 * 64
    assert local_numel((3, 5), 4) == 5
    assert local_numel((), 8) == 1


def test_half_precision_storage_halves_bytes():
    model = Small().to(torch.bfloat16)
    plan = build_plan(FSDP2Config(sharding_size="auto"), model, 2)
    assert per_rank_memory(model, plan).params * 2 == per_rank_memory(Small(), plan).params


def test_bytes_two_ranks_hold_equal_the_accounting(scenario):
    """A regression in sharding (a unit left whole, an ignored module sharded, a lost optimiser state) shows here."""
    from tests.scenarios import dist_scenarios

    for r in scenario(dist_scenarios.memory_accounting):
        assert r["measured"] == {k: r["expected"][k] for k in ("params", "grads", "optimizer")}
        # embed + 3 layers + head sharded in halves, the ignored encoder (16x32 + 32 = 544 floats) whole.
        sharded = (64 * 32 + 3 * (32 * 32 + 32) + 64 * 32 + 64) // 2
        assert r["expected"]["params"] == (sharded + 544) * 4
        assert r["expected"]["optimizer"] == 2 * r["expected"]["grads"]
