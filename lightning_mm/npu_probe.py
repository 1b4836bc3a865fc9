"""Whether torch_npu and an Ascend NPU are there, without Lightning (``lightning-mm env`` uses it too).

torch_npu is imported only by :func:`npu_status`, and only when it is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

__all__ = ["INSTALL_HINT", "VISIBLE_DEVICES", "npu_status", "torch_npu_version"]

INSTALL_HINT = (
    "install the Ascend driver and CANN toolkit, `source /usr/local/Ascend/ascend-toolkit/set_env.sh`, then "
    "`pip install lightning-mm[npu]` (a torch_npu release built for torch {torch})"
)
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"


def torch_npu_version() -> str | None:
    """torch_npu's version if it is installed, without importing it (``None`` if not installed)."""
    module = sys.modules.get("torch_npu")
    if module is not None:
        return str(getattr(module, "__version__", "unknown"))
    from importlib.metadata import PackageNotFoundError, version

    for dist_name in ("torch-npu", "torch_npu"):
        try:
            return version(dist_name)
        except PackageNotFoundError:
            continue
    return None


def npu_status() -> tuple[int, str | None]:
    """``(number of visible NPUs, None)``, or ``(0, why there is none)``; never raises.

    Imports torch_npu when it is installed (that is how NPUs are counted); when it is not, imports nothing.
    """
    hint = INSTALL_HINT.format(torch=torch.__version__.split("+")[0])
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return 0, f"torch_npu is not installed: {hint}"
    try:
        importlib.import_module("torch_npu")
    except ModuleNotFoundError as err:
        if err.name == "torch_npu":
            return 0, f"torch_npu is not installed: {hint}"
        return 0, _broken(err, hint)
    except Exception as err:  # a missing CANN library surfaces as ImportError, OSError or RuntimeError
        return 0, _broken(err, hint)
    try:
        count = int(torch.get_device_module("npu").device_count())
    except Exception as err:
        return 0, f"torch_npu is imported but cannot count NPUs ({type(err).__name__}: {err}); {hint}"
    if count == 0:
        visible = os.environ.get(VISIBLE_DEVICES)
        where = f" ({VISIBLE_DEVICES}={visible!r})" if visible is not None else ""
        return 0, (
            f"torch_npu {torch_npu_version()} is installed but no NPU is visible{where}: check the driver with "
            "`npu-smi info` and that the CANN environment is sourced"
        )
    return count, None


def _broken(err: BaseException, hint: str) -> str:
    return (
        f"torch_npu is installed but cannot be imported ({type(err).__name__}: {err}). This usually means the CANN "
        f"toolkit is missing or its environment is not sourced, or torch_npu does not match torch: {hint}"
    )
