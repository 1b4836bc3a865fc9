import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "tests" / "dist_scenarios.py"


def run_scenario(
    name: str, outdir: Path, expect_ok: bool = True, timeout: int = 300, script: Path = SCENARIOS
) -> subprocess.CompletedProcess:
    """Run ``tests/dist_scenarios.py NAME OUTDIR`` (or another ``script``) as a 2-rank Lightning job in a fresh
    process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, str(script), name, str(outdir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"scenario {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def read_ranks(name: str, outdir: Path) -> list[dict]:
    return [json.loads((outdir / f"{name}.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture
def scenario(tmp_path):
    def _run(name: str):
        run_scenario(name, tmp_path)
        return read_ranks(name, tmp_path)

    return _run
