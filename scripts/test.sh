#!/usr/bin/env bash
# Installs (scripts/install.sh) and runs the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m ruff check lightning_mm tests examples benchmarks scripts
.venv/bin/python -m ruff format --check lightning_mm tests examples benchmarks scripts
.venv/bin/python -m mypy  # the package, configured in pyproject.toml
.venv/bin/python -m pytest -q "$@"
