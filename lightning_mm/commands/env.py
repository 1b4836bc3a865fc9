"""``lightning-mm env``: the versions, accelerators and distributed backends of this machine, for bug reports.

Reports torch, torch_npu (if installed), lightning, transformers and lightning-mm versions; for each accelerator
Lightning knows (NPU included), whether it is available and how many devices it has; the distributed backends
PyTorch can use here; and what ``Trainer(accelerator="auto", devices="auto")`` would choose. When torch_npu is
installed it is imported here, to count NPUs. Lightning is imported (what is reported is Lightning's view of the
machine); Transformers and the rest of lightning-mm are not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["main", "collect", "format_report"]

_PACKAGES = ("torch", "lightning", "transformers", "lightning-mm")
_ENV_VARS = ("ASCEND_RT_VISIBLE_DEVICES", "ASCEND_HOME_PATH", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT",
             "WORLD_SIZE", "TORCH_DEVICE_BACKEND_AUTOLOAD")


def _version(dist_name: str) -> str | None:
    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def _accelerators() -> dict[str, dict[str, Any]]:
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from lightning_mm.accelerators.npu import npu_status

    report: dict[str, dict[str, Any]] = {}
    for name in sorted(AcceleratorRegistry.available_accelerators()):
        cls = AcceleratorRegistry[name]["accelerator"]
        entry: dict[str, Any] = {"class": cls.__name__}
        try:
            entry["available"] = bool(cls.is_available())
            entry["devices"] = int(cls.auto_device_count()) if entry["available"] else 0
        except Exception as err:  # report, never crash: this output goes into bug reports
            entry.update(available=False, devices=0, error=f"{type(err).__name__}: {err}")
        if name == "npu" and not entry["available"]:
            entry["reason"] = npu_status()[1]
        report[name] = entry
    return report


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
    from lightning_mm._compat import auto_accelerator

    choice = auto_accelerator()
    return {"accelerator": choice, "devices": accelerators.get(choice, {}).get("devices")}


def collect() -> dict[str, Any]:
    """Everything the report shows, as plain data."""
    import torch
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from lightning_mm.accelerators.npu import NPUAccelerator, torch_npu_version

    # accelerator="npu" in Lightning's registry; the rest of lightning_mm stays unimported
    NPUAccelerator.register_accelerators(AcceleratorRegistry)

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
