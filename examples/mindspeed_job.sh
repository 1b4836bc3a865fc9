#!/usr/bin/env bash
# A MindSpeed MM VLM job, end to end on 2 CPU processes, from the repository root:
#   bash examples/mindspeed_job.sh qwen3vl     # MindSpeed MM's single-YAML Qwen3-VL launch
#   bash examples/mindspeed_job.sh qwen2_5vl   # its flag-style Qwen2.5-VL launch with data.json and model.json
# 1. writes the tiny stand-in of the downloaded checkpoint and data (runs/<job>/hf_path, runs/<job>/data);
# 2. `lightning-mm migrate` turns the launch script into runs/<job>/config.yaml (the report lists every key);
# 3. `lightning-mm fit` trains it (checkpoints in runs/<job>/save_dir, replaced on each run);
# 4. `lightning-mm convert dcp-to-hf` writes runs/<job>/hf_out (weights, tokenizer, processor, chat template);
# 5. the converted directory answers a question about a picture with Transformers' `generate`.
# Extra arguments go to `lightning-mm fit` (e.g. --trainer.max_steps=4). Installs into ./.venv first, as the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  qwen3vl)   LAUNCH=examples/qwen3vl/finetune_qwen3vl_8B.sh;      FAMILY=qwen3_vl;   NAME=Qwen3-VL-tiny ;;
  qwen2_5vl) LAUNCH=examples/qwen2_5vl/finetune_qwen2_5_vl_7b.sh; FAMILY=qwen2_5_vl; NAME=Qwen2.5-VL-tiny ;;
  *) echo "usage: bash examples/mindspeed_job.sh {qwen3vl|qwen2_5vl} [lightning-mm fit arguments]" >&2; exit 2 ;;
esac
JOB=$1; shift
RUN=runs/$JOB
[ "${LIGHTNING_MM_SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh
PY=.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
set -x
$PY -m examples.vlm_stand_in "$RUN" --family "$FAMILY" --model-name "$NAME"
.venv/bin/lightning-mm migrate "$LAUNCH" -o "$RUN/config.yaml" --force
rm -rf "$RUN/save_dir" "$RUN/hf_out"
.venv/bin/lightning-mm fit --config "$RUN/config.yaml" "$@"
.venv/bin/lightning-mm convert dcp-to-hf "$RUN/save_dir/last.ckpt" "$RUN/hf_out"
$PY -m examples.generate_from_hf "$RUN/hf_out" "$RUN/data/images/000.png"
