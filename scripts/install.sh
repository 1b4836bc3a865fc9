#!/usr/bin/env bash
# Installs lightning-mm and what its tests need into ./.venv (created if missing).
# torch is pinned to the CPU build first so that nothing pulls a multi-GB CUDA wheel by accident.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
