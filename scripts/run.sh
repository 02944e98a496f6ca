#!/usr/bin/env bash
# Install everything and run the main job on the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/kvwise generate "${@:-Explain what a KV cache is in two sentences.}"
