"""DTensor helpers on a real 1-rank gloo process group (never inside the pytest process):
``python tests/scenarios/dtensor_scenarios.py SCENARIO WORKDIR`` (tests/helpers/scenario_kit.py). Imports only torch."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario, write_result  # noqa: E402


@scenario
def local_tensor_of_a_dtensor(workdir: Path) -> None:
    """``lightning_mm._utils.distributed.local_tensor`` of a DTensor sharded over a 1-rank mesh: a plain tensor, the
    whole."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_mm._utils.distributed import local_tensor

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    full = torch.arange(6.0).reshape(3, 2)
    local = local_tensor(distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(0)]))
    seen = {"plain_tensor": type(local) is torch.Tensor, "equal": torch.equal(local, full)}
    write_result(workdir, "local_tensor_of_a_dtensor", seen)
    dist.destroy_process_group()


if __name__ == "__main__":
    scenario_kit.main()
