#!/usr/bin/env bash
# Installs (scripts/install.sh) and runs the whole test suite. CI runs exactly this.
# With no arguments: the inner tier (every test that runs in the pytest process alone), then the multiprocess tier
# (scenario launches, CLI and script runs; marked automatically, tests/helpers/tiers.py): each test runs once.
# With arguments: one pytest run with them (a file, -k, -m ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m ruff check lightning_mm tests examples benchmarks scripts
.venv/bin/python -m ruff format --check lightning_mm tests examples benchmarks scripts
.venv/bin/python -m mypy  # the package, configured in pyproject.toml
if [ "$#" -gt 0 ]; then
    .venv/bin/python -m pytest -q "$@"
else
    .venv/bin/python -m pytest -q -m "not multiprocess"  # the inner tier first: fails fast
    .venv/bin/python -m pytest -q -m multiprocess
fi
