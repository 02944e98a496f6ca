#!/usr/bin/env bash
# Install everything (test dependencies included) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
KVWISE_EXTRAS=test bash scripts/install.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
