#!/usr/bin/env bash
# Installs lightning-mm and what its tests need into ./.venv (created if missing).
#
# torch is installed first, deliberately (LIGHTNING_MM_TORCH, default `auto`):
#   auto     the CPU build from PyTorch's CPU wheel index on a machine without an NVIDIA GPU (Ascend NPU machines
#            included: torch_npu runs on the CPU build), the default build (CUDA) from the default index where
#            an NVIDIA GPU is present;
#   cpu      the CPU build;   default   whatever the default index (and your pip config) gives;
#   skip     keep the torch already in .venv (or install none).
# The CPU index is probed first (5 s); when it cannot be reached the default index is used, with a warning
# (on a machine without local wheels that may be the large CUDA build). LIGHTNING_MM_TORCH_INDEX names another
# CPU index (a mirror). A constraints.txt at the repository root constrains every install.
# `install.sh --dry-run` prints the torch install it would run, and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC="torch==2.13.0"
CHOICE=${LIGHTNING_MM_TORCH:-auto}
CPU_INDEX=${LIGHTNING_MM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
say() { echo "install.sh: $*" >&2; }

DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
PIP=(.venv/bin/python -m pip install -q)
[ -f constraints.txt ] && PIP+=(-c constraints.txt)

has_nvidia_gpu() {
  [ -e /proc/driver/nvidia/version ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
}
index_reachable() {
  "$PY" - "$1" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception:
    sys.exit(1)
EOF
}

case "$CHOICE" in
  auto) if has_nvidia_gpu; then CHOICE=default; say "NVIDIA GPU found: torch from the default index (CUDA build)";
        else CHOICE=cpu; fi ;;
  cpu|default|skip) ;;
  *) say "LIGHTNING_MM_TORCH must be auto, cpu, default or skip (got '$CHOICE')"; exit 2 ;;
esac
TORCH_INSTALL=()
if [ "$CHOICE" = cpu ]; then
  if [ -x .venv/bin/python ] \
     && .venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is not None \
                             or torch.__version__.split('+')[0] != '${TORCH_SPEC#torch==}')" 2>/dev/null; then
    : # the CPU build of the pinned version is already there
  elif index_reachable "$CPU_INDEX"; then
    say "torch CPU build from $CPU_INDEX"
    TORCH_INSTALL=(--index-url "$CPU_INDEX" "$TORCH_SPEC")
  else
    say "warning: $CPU_INDEX cannot be reached; torch from the default index (set LIGHTNING_MM_TORCH_INDEX to a"
    say "reachable CPU index, or install torch yourself and use LIGHTNING_MM_TORCH=skip)"
    TORCH_INSTALL=("$TORCH_SPEC")
  fi
elif [ "$CHOICE" = default ]; then
  TORCH_INSTALL=("$TORCH_SPEC")
fi
if [ "$DRY_RUN" = 1 ]; then
  echo "torch: $CHOICE: ${TORCH_INSTALL[*]:-(nothing to install)}"
  exit 0
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
"${PIP[@]}" --upgrade pip
[ ${#TORCH_INSTALL[@]} -eq 0 ] || "${PIP[@]}" "${TORCH_INSTALL[@]}"
"${PIP[@]}" -e ".[test]"
