#!/usr/bin/env bash
# Every CPU benchmark in one command, 2 ranks on this machine -> benchmarks/results/*.json and *.png.
#
#   bash benchmarks/run_cpu.sh            # before each stage, waits for a 1-minute load average < MAX_LOAD=0.5
#                                         # (at most WAIT_S=1800 s of waiting in all, then measures anyway)
#   QUICK=1 bash benchmarks/run_cpu.sh    # fewer rounds and steps, results to /tmp/lmm_bench/quick_results
#                                         # (a check that everything runs, ~5 minutes)
#
# Needs the `bench` extra (matplotlib): pip install -e ".[bench]". Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
MAX_LOAD=${MAX_LOAD:-0.5}
WAIT_S=${WAIT_S:-1800}

WAITED=0
wait_for_quiet() {
  while :; do
    local load
    load=$(cut -d' ' -f1 /proc/loadavg)
    if awk -v l="$load" -v m="$MAX_LOAD" 'BEGIN{exit !(l < m)}'; then break; fi
    if [ "$WAITED" -ge "$WAIT_S" ]; then echo "load $load >= $MAX_LOAD, waited ${WAITED}s in all: measuring anyway"; break; fi
    echo "load $load >= $MAX_LOAD: waiting (${WAITED}s waited so far)"
    sleep 60
    WAITED=$((WAITED + 60))
  done
  echo "load before $1: $(cat /proc/loadavg)"
}

if [ "${QUICK:-0}" = "1" ]; then
  ROUNDS=2; STEPS=10; WARMUP=3
  export LMM_BENCH_RESULTS=${LMM_BENCH_RESULTS:-/tmp/lmm_bench/quick_results}  # keep the recorded results
  mkdir -p "$LMM_BENCH_RESULTS"
else
  ROUNDS=12; STEPS=15; WARMUP=5
fi

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/{print $2}') GiB"

wait_for_quiet "step_time"
# 1. Step time: MMFSDP2Strategy vs the same plan by hand (ModelParallelStrategy), FSDP1, DDP.
$PY benchmarks/step_time.py --models lm,vlm --rounds $ROUNDS --steps $STEPS --warmup $WARMUP --name step_time

wait_for_quiet "step_time_vlm_pair"
# The sharded contenders alone on the multimodal model, more rounds (its 4-way ratios are the noisiest).
$PY benchmarks/step_time.py --models vlm --contenders mm_fsdp2,hand_fsdp2,fsdp1 --rounds $((ROUNDS + 8)) \
  --steps $STEPS --warmup $WARMUP --name step_time_vlm_pair

wait_for_quiet "fsdp1_pair"
# The strategy against FSDP1 alone, both models, 30 rounds.
$PY benchmarks/step_time.py --models lm,vlm --contenders mm_fsdp2,fsdp1 --rounds $((ROUNDS + 18)) --steps $STEPS \
  --warmup $WARMUP --name fsdp1_pair

# Per-step Python work of each contender, counted under cProfile (does not depend on the load).
$PY benchmarks/overhead_profile.py
$PY benchmarks/report.py --plot overhead_profile

wait_for_quiet "tuning"
# Tuning, before/after: the fused optimiser step (before_fused = torch's choice), the root and last unit kept
# unsharded (before_keep = every unit resharded), a forward prefetch of 1 for a YAML that leaves it out, and
# non-reentrant recomputation (the seed's default is reentrant; only the VLM recomputes).
$PY benchmarks/step_time.py --models lm,vlm \
  --contenders mm_fsdp2,mm_fsdp2@before_fused,mm_fsdp2@before_keep,mm_fsdp2@fwd1,mm_fsdp2@nonreentrant \
  --rounds $ROUNDS --steps $STEPS --warmup $WARMUP --name tuning

# MMLightningModule's own per-step cost: its metrics synchronised only on the steps whose logs are written
# (before_lazylog = every step), next to the plain LightningModule under the same strategy.
$PY benchmarks/step_time.py --models lm,vlm --contenders mm_module,mm_module@before_lazylog,mm_fsdp2 \
  --rounds $ROUNDS --steps $STEPS --warmup $WARMUP --name tuning_module

# Forward prefetch 1 vs the default 0 for a YAML that leaves it out, the two alone.
$PY benchmarks/step_time.py --models lm --contenders mm_fsdp2,mm_fsdp2@fwd1 --rounds $((ROUNDS + 8)) --steps $STEPS \
  --warmup $WARMUP --name tuning_fwd_pair

# 2. Memory per rank: exact bytes vs DDP, tracked peaks per YAML setting (byte counts: load does not matter).
$PY benchmarks/memory_bench.py

# 3. Initialisation of a 1.54 B-parameter fp32 model: meta device vs eager, one launch each.
wait_for_quiet "init"
$PY benchmarks/init_bench.py

# AdamW over DTensor parameters: torch's CPU default, foreach (rejected) and fused (the strategy's default).
wait_for_quiet "optimizer_step"
$PY benchmarks/optimizer_step.py
$PY benchmarks/report.py --plot optimizer_step

# 4. Checkpoint save/load (benchmarks/checkpoint_bench.py, from the checkpoint work), when present.
if [ -f benchmarks/checkpoint_bench.py ]; then
  wait_for_quiet "checkpoint"
  $PY benchmarks/checkpoint_bench.py --dir /tmp/lmm_bench/checkpoint
  cp /tmp/lmm_bench/checkpoint/results.json "${LMM_BENCH_RESULTS:-benchmarks/results}/checkpoint.json"
  $PY benchmarks/report.py --plot-checkpoint
fi

# Chunked cross-entropy (issue #25, 5(b) and 5(c)): the loss's peak memory and step time against the full loss.
wait_for_quiet "chunk_loss"
if [ "${QUICK:-0}" = "1" ]; then
  $PY benchmarks/chunk_loss_bench.py --rounds 1 --steps 1 --time-tokens 512
else
  $PY benchmarks/chunk_loss_bench.py --rounds 3 --steps 2
fi

# Compute-bound step time (issue #29): the strategy against the same per-rank work with no communication.
wait_for_quiet "compute_bound"
if [ "${QUICK:-0}" = "1" ]; then
  $PY benchmarks/compute_bound.py --rounds 1 --steps 1 --warmup 1 --contenders no_comm,mm_fsdp2
else
  $PY benchmarks/compute_bound.py
fi

# 5. GPU throughput needs CUDA GPUs: python benchmarks/gpu_throughput.py (see benchmarks/README.md).
echo "done: ${LMM_BENCH_RESULTS:-benchmarks/results}/"
