"""``lightning-mm env``: the versions, accelerators and distributed backends of this machine, for bug reports.

Reports torch, torch_npu (if installed), lightning, transformers and lightning-mm versions; for each accelerator
Lightning knows (NPU included), whether it is available and how many devices it has; the distributed backends
PyTorch can use here; and what ``Trainer(accelerator="auto", devices="auto")`` would choose. When torch_npu is
installed it is imported here, to count NPUs. Lightning and Transformers are not imported: Lightning's view of the
machine is asked of torch the way Lightning asks it (``tests/test_npu.py`` checks it against Lightning's own).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["main", "collect", "format_report"]

_PACKAGES = ("torch", "lightning", "transformers", "lightning-mm")
_ENV_VARS = (
    "ASCEND_RT_VISIBLE_DEVICES",
    "ASCEND_HOME_PATH",
    "CUDA_VISIBLE_DEVICES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
)


def _version(dist_name: str) -> str | None:
    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def _lightning_accelerators() -> dict[str, dict[str, Any]]:
    """Each accelerator in Lightning's registry, asked through Lightning (imports Lightning)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from lightning_mm.accelerators.npu import NPUAccelerator

    NPUAccelerator.register_accelerators(AcceleratorRegistry)  # accelerator="npu"
    report: dict[str, dict[str, Any]] = {}
    for name in sorted(AcceleratorRegistry.available_accelerators()):
        cls = AcceleratorRegistry[name]["accelerator"]
        entry: dict[str, Any] = {"class": cls.__name__}
        try:
            entry["available"] = bool(cls.is_available())
            entry["devices"] = int(cls.auto_device_count()) if entry["available"] else 0
        except Exception as err:  # report, never crash: this output goes into bug reports
            entry.update(available=False, devices=0, error=f"{type(err).__name__}: {err}")
        report[name] = entry
    return report


def _accelerators() -> dict[str, dict[str, Any]]:
    """What Lightning's accelerators (cpu, cuda, mps, tpu, and npu from lightning-mm) would find, asked of torch
    directly as Lightning asks it, so that this command does not import Lightning. With torch_xla installed, the
    answer needs Lightning's XLA probing, and Lightning is asked instead."""
    import torch

    from lightning_mm.npu_probe import npu_status

    if importlib.util.find_spec("torch_xla") is not None:
        report = _lightning_accelerators()
    else:
        cuda = torch.cuda.device_count()
        mps = (
            os.getenv("DISABLE_MPS", "0") != "1"
            and torch.backends.mps.is_available()
            and platform.processor() in ("arm", "arm64")
        )
        report = {
            "cpu": {"class": "CPUAccelerator", "available": True, "devices": 1},
            "cuda": {"class": "CUDAAccelerator", "available": cuda > 0, "devices": cuda},
            "mps": {"class": "MPSAccelerator", "available": mps, "devices": 1 if mps else 0},
            "tpu": {"class": "XLAAccelerator", "available": False, "devices": 0},
        }
    count, reason = npu_status()
    report["npu"] = {"class": "NPUAccelerator", "available": count > 0, "devices": count}
    if reason:
        report["npu"]["reason"] = reason
    return dict(sorted(report.items()))


def _backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {}
    names = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    if "hccl" not in names:
        names.append("hccl")  # registered by torch_npu when it is imported
    found: dict[str, bool] = {}
    for name in names:
        try:
            found[name] = bool(dist.is_backend_available(name))
        except Exception:
            found[name] = False
    return found


def _auto_choice(accelerators: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What ``Trainer(accelerator="auto", devices="auto")`` picks: Lightning's order (tpu, mps, cuda, else cpu;
    never the NPU, which must be asked for by name)."""
    choice = next((name for name in ("tpu", "mps", "cuda") if accelerators[name]["available"]), "cpu")
    return {"accelerator": choice, "devices": accelerators[choice]["devices"]}


def collect() -> dict[str, Any]:
    """Everything the report shows, as plain data."""
    import torch

    from lightning_mm.npu_probe import torch_npu_version

    accelerators = _accelerators()  # imports torch_npu if it is installed
    current = torch.accelerator.current_accelerator()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {**{name: _version(name) for name in _PACKAGES}, "torch_npu": torch_npu_version()},
        "torch_build": {"cuda": torch.version.cuda, "git": torch.version.git_version[:12]},
        "torch_accelerator": current.type if current is not None else None,
        "accelerators": accelerators,
        "distributed_backends": _backends(),
        "auto": _auto_choice(accelerators),
        "cpu_count": os.cpu_count(),
        "env": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
    }


def format_report(info: dict[str, Any]) -> str:
    """The human-readable report of :func:`collect`'s data."""
    lines = [f"python:        {info['python']} ({info['platform']})"]
    for name, ver in info["versions"].items():
        lines.append(f"{name + ':':<14} {ver if ver is not None else 'not installed'}")
    lines.append(f"torch build:   cuda {info['torch_build']['cuda']}, git {info['torch_build']['git']}")
    lines.append(f"torch.accelerator: {info['torch_accelerator'] or 'none (CPU only)'}")
    lines.append("accelerators:")
    for name, entry in info["accelerators"].items():
        state = f"available, {entry['devices']} device(s)" if entry["available"] else "not available"
        detail = entry.get("reason") or entry.get("error")
        lines.append(f"  {name:<6} {state}" + (f" ({detail})" if detail else ""))
    backends = info["distributed_backends"]
    if backends:
        lines.append("distributed backends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in backends.items()))
    else:
        lines.append("distributed backends: torch.distributed is not available")
    auto = info["auto"]
    lines.append(f'accelerator="auto" chooses: {auto["accelerator"]} (devices="auto" -> {auto["devices"]})')
    lines.append(f"cpu count:     {info['cpu_count']}")
    for key, value in info["env"].items():
        lines.append(f"env {key}={value}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-mm env", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(list(argv) if argv is not None else sys.argv[1:])
    info = collect()
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 0
