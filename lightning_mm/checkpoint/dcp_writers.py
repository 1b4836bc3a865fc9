"""DCP storage writers' shared behaviour (the local one of :mod:`.dcp_format`, the fsspec one of :mod:`.remote`)."""

from __future__ import annotations

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

__all__ = ["NoEmptyFiles"]


class NoEmptyFiles:
    """A DCP storage writer (mixed in before it) that writes no file for a rank with nothing to write.

    DCP's file writers open one file per rank (per thread) whatever its plan holds: a rank whose plan is empty
    (``checkpoint_format="hf"``, whose DCP part holds no model or optimiser tensors; a replicated tensor that DCP
    writes from one rank only) would leave a 0-byte ``__<rank>_0.distcp``, which nothing reads.
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        if not plan.items:
            done: Future = Future()
            done.set_result([])
            return done
        return super().write_data(plan, planner)  # type: ignore[misc]
