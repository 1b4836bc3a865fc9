"""scripts/install.sh chooses the torch build deliberately (checked with --dry-run: nothing is installed)."""

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def checkout(tmp_path):
    """A repository root with the install script and no .venv (so no torch is found installed)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    return tmp_path


def dry_run(root: Path, path_prefix: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **env}
    for key in ("LIGHTNING_MM_TORCH", "LIGHTNING_MM_TORCH_INDEX"):
        full.pop(key, None) if key not in env else None
    if path_prefix is not None:
        full["PATH"] = f"{path_prefix}{os.pathsep}{full['PATH']}"
    return subprocess.run(
        ["bash", str(root / "scripts" / "install.sh"), "--dry-run"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def cpu_index(tmp_path):
    """A local stand-in for PyTorch's CPU wheel index (it only has to answer for /torch/)."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="this machine has an NVIDIA GPU")
def test_cpu_build_from_the_cpu_index_without_a_gpu(checkout, cpu_index):
    proc = dry_run(checkout, LIGHTNING_MM_TORCH_INDEX=cpu_index)
    assert proc.stdout.strip() == f"torch: cpu: --index-url {cpu_index} torch==2.13.0", proc.stderr


def test_default_build_where_a_gpu_is_present(checkout, tmp_path, cpu_index):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
    (fake / "nvidia-smi").chmod(0o755)
    proc = dry_run(checkout, path_prefix=fake, LIGHTNING_MM_TORCH_INDEX=cpu_index)
    assert proc.stdout.strip() == "torch: default: torch==2.13.0", proc.stderr


def test_unreachable_cpu_index_falls_back_at_once_with_a_warning(checkout):
    proc = dry_run(checkout, LIGHTNING_MM_TORCH="cpu", LIGHTNING_MM_TORCH_INDEX="http://127.0.0.1:9/")
    assert proc.stdout.strip() == "torch: cpu: torch==2.13.0"
    assert "cannot be reached" in proc.stderr


def test_override_and_bad_override(checkout):
    assert dry_run(checkout, LIGHTNING_MM_TORCH="skip").stdout.strip() == "torch: skip: (nothing to install)"
    proc = dry_run(checkout, LIGHTNING_MM_TORCH="cuda")
    assert proc.returncode == 2 and "must be auto, cpu, default or skip" in proc.stderr
