#!/usr/bin/env bash
# Installs (scripts/install.sh) and trains the demo: the seed's fsdp2_config.yaml on 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/lightning-mm fit --config examples/captioning/config.yaml "$@"
