"""A 2-rank fit over data with an image that passes the up-front check and fails to decode (issue #12, point 6)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.hostile_files import write_captioning_data

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "hostile_scenarios.py"


def run_hostile(name: str, outdir: Path, timeout: int = 240) -> list[dict]:
    """``tests/hostile_scenarios.py NAME OUTDIR`` as a 2-rank job in its own session; on a timeout every process
    of that session is killed (a rank left waiting in a collective must not outlive the test)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), name, str(outdir)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"scenario {name} did not finish in {timeout} s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, f"scenario {name} failed ({proc.returncode}):\n{output[-6000:]}"
    return [json.loads((outdir / f"{name}.rank{r}.json").read_text()) for r in range(2)]


def test_a_corrupt_pixel_stream_is_skipped_and_counted_in_a_two_rank_fit(tmp_path):
    write_captioning_data(tmp_path / "data", good=7, corrupt_line=3)
    ranks = run_hostile("corrupt_image", tmp_path)
    assert [r["steps"] for r in ranks] == [4, 4]  # 8 records / 2 ranks / batch 2, 2 epochs: nothing lost, no hang
    problems = [p for r in ranks for p in r["problems"]]
    assert len(problems) == 1 and "train.jsonl:3: cannot decode image" in problems[0], problems
