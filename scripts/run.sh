#!/usr/bin/env bash
# Install everything and run the main job: the OpenAI-compatible server on the default model
# (http://127.0.0.1:8000/v1). Extra arguments go to `kvwise serve` (see `kvwise serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/kvwise serve "$@"
