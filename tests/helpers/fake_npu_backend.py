"""TEST DOUBLE: a fake Ascend ``npu`` device type, for tests on machines without an NPU or torch_npu.

``install()`` uses PyTorch's public out-of-tree backend API, as torch_npu itself does:

* ``torch.utils.rename_privateuse1_backend("npu")``: ``torch.device("npu", i)`` and ``torch.autocast("npu")`` exist;
* ``torch._register_device_module("npu", module)``: ``torch.npu`` is a small Python module (``FakeNPUModule``) with
  the functions lightning-mm calls (device_count, set_device, memory_stats, empty_cache, ...); it records the calls;
* a stand-in ``torch_npu`` module in ``sys.modules``, so that the lazy ``import torch_npu`` succeeds.

What it covers: lightning-mm's own NPU logic (availability, device counting and parsing, the parallel devices,
``strategy="single_npu"`` (one device and mixed precision), ``accelerator="auto"`` staying Lightning's choice,
that autocast runs on the npu device type, setup_device/get_device_stats/teardown reaching ``torch.npu``, the
process-group backend chosen for npu devices, and ``lightning-mm env``).

What it does NOT cover: no tensor can be allocated on the fake device (no allocator, no kernels), so no training
step, no HCCL collective, no real torch_npu or CANN import, no real memory numbers. Those need Ascend hardware.

Renaming PrivateUse1 is process-global and irreversible: call ``install()`` only in a subprocess started for it
(``tests/test_npu.py`` sets ``LIGHTNING_MM_FAKE_NPU_SUBPROCESS=1``), never in the pytest process. Call it after
``import lightning_mm``: transformers probes for torch_npu once, at import, and would take the stand-in for the
real one.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from typing import Any

import torch

__all__ = ["FakeNPUModule", "install", "SUBPROCESS_FLAG"]

SUBPROCESS_FLAG = "LIGHTNING_MM_FAKE_NPU_SUBPROCESS"


class FakeNPUModule(types.ModuleType):
    """Stands in for ``torch.npu``: a settable device count, recorded calls, fixed memory statistics."""

    def __init__(self, count: int) -> None:
        super().__init__("torch.npu")
        self.count = count
        self.calls: list[tuple[str, Any]] = []
        self.current = 0

    def device_count(self) -> int:
        return self.count

    def is_available(self) -> bool:
        return self.count > 0

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: Any) -> None:
        self.calls.append(("set_device", str(device)))
        self.current = torch.device(device).index or 0

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        self.calls.append(("memory_stats", str(device)))
        return {"allocated_bytes.all.current": 1024, "allocated_bytes.all.peak": 4096}

    def max_memory_allocated(self, device: Any = None) -> int:
        return 4096

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", None))

    def synchronize(self, device: Any = None) -> None:
        self.calls.append(("synchronize", str(device)))

    # what torch.autocast asks a PrivateUse1 device module for
    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported(self, *args: Any, **kwargs: Any) -> bool:
        return True


def install(device_count: int = 2) -> FakeNPUModule:
    """Make ``npu`` a device type backed by a :class:`FakeNPUModule` (see the module docstring); returns it."""
    if os.environ.get(SUBPROCESS_FLAG) != "1":
        raise RuntimeError(
            f"the fake NPU backend renames PrivateUse1 for good: install it only in a subprocess "
            f"started with {SUBPROCESS_FLAG}=1"
        )
    torch.utils.rename_privateuse1_backend("npu")
    module = FakeNPUModule(device_count)
    torch._register_device_module("npu", module)
    stand_in = types.ModuleType("torch_npu")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    stand_in.__version__ = "0.0.0+fake"
    sys.modules["torch_npu"] = stand_in
    return module
