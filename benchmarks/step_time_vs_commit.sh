#!/usr/bin/env bash
# The step-time pair (MMFSDP2Strategy vs the same plan by hand, decoder LM, 2 ranks) at this tree and at another
# commit, alternating run by run so that drift on the machine falls on both alike.
#
#   bash benchmarks/step_time_vs_commit.sh REF [RUNS=4] [ROUNDS=3] [STEPS=15]
#
# Each run is `benchmarks/step_time.py --models lm --contenders mm_fsdp2,hand_fsdp2` in a git worktree of REF (a
# temporary one, removed at the end) or here, with the same Python environment; the package under test is the one
# in the tree the benchmark runs from (PYTHONPATH). Prints, per tree, every run's median ms/step of both contenders
# and the pair's ratio, then the medians over runs and this tree / REF. Results: $OUT (default /tmp/lmm_vs_commit).
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:?usage: step_time_vs_commit.sh REF [RUNS] [ROUNDS] [STEPS]}
RUNS=${2:-4}
ROUNDS=${3:-3}
STEPS=${4:-15}
PY=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=$PWD/.venv/bin/python; fi
OUT=${OUT:-/tmp/lmm_vs_commit}
HERE=$PWD
THERE=$(mktemp -d /tmp/lmm_ref.XXXXXX)
rm -rf "$OUT" && mkdir -p "$OUT"
git worktree add -q --detach "$THERE" "$REF"
trap 'git worktree remove --force "$THERE"' EXIT

run() {  # tree label index
  local tree=$1 label=$2 i=$3
  (cd "$tree" && PYTHONPATH="$tree" LMM_BENCH_RESULTS="$OUT/$label.$i" "$PY" -c \
     "import lightning_mm, sys; assert lightning_mm.__file__.startswith('$tree'), lightning_mm.__file__" &&
   PYTHONPATH="$tree" LMM_BENCH_RESULTS="$OUT/$label.$i" "$PY" benchmarks/step_time.py --models lm \
     --contenders mm_fsdp2,hand_fsdp2 --rounds "$ROUNDS" --steps "$STEPS" --warmup 5 --name pair \
     > "$OUT/$label.$i.log" 2>&1) || { echo "run $label.$i failed: see $OUT/$label.$i.log"; exit 1; }
}

for i in $(seq 1 "$RUNS"); do
  if [ $((i % 2)) -eq 1 ]; then run "$HERE" head "$i"; run "$THERE" ref "$i"; else run "$THERE" ref "$i"; run "$HERE" head "$i"; fi
  echo "run $i of $RUNS done"
done

"$PY" - "$OUT" "$RUNS" "$(git rev-parse --short HEAD)" "$(git -C "$THERE" rev-parse --short HEAD)" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, runs, head, ref = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
table = {}
for label in ("head", "ref"):
    for i in range(1, runs + 1):
        summary = json.loads((out / f"{label}.{i}" / "pair.json").read_text())["summary"]["lm"]
        ms = summary["median_step_ms"]
        table.setdefault(label, []).append((ms["mm_fsdp2"], ms["hand_fsdp2"], summary["ratios"]["mm_fsdp2/hand_fsdp2"]["median"]))
for label, name in (("head", f"this tree ({head})"), ("ref", f"REF ({ref})")):
    rows = table[label]
    print(f"{name}: mm_fsdp2 ms/step per run {[round(r[0], 1) for r in rows]}, hand {[round(r[1], 1) for r in rows]}, "
          f"mm/hand {[round(r[2], 3) for r in rows]}")
mm = {k: statistics.median(r[0] for r in v) for k, v in table.items()}
pair = {k: statistics.median(r[2] for r in v) for k, v in table.items()}
print(f"median mm_fsdp2 ms/step: this tree {mm['head']:.1f}, REF {mm['ref']:.1f}, ratio {mm['head'] / mm['ref']:.3f}")
print(f"median mm/hand: this tree {pair['head']:.3f}, REF {pair['ref']:.3f}")
EOF
