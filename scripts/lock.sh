#!/usr/bin/env bash
# Regenerate the locks in requirements/ from pyproject.toml's ranges: the newest releases they
# allow, resolved by pip-compile (pip-tools, in a scratch venv of its own, not in .venv)
# through pip's own configuration, against torch from requirements/torch.txt.
#   requirements/lock.txt          runtime + the test and ray extras (KVWISE_EXTRAS=test)
#   requirements/lock-runtime.txt  runtime only, the same versions (scripts/run.sh)
# Then `bash scripts/test_newest.sh` (or scripts/test.sh) checks them. Extra arguments go to
# pip-compile for requirements/lock.txt (e.g. `-c FILE` to hold a release back).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP_TOOLS="pip-tools==7.7.0"
tools="${TMPDIR:-/tmp}/kvwise-lock-tools"
if ! "$tools/bin/pip-compile" --version 2>/dev/null | grep -q "${PIP_TOOLS#*==}"; then
  rm -rf "$tools"
  "$PY" -m venv "$tools"
  "$tools/bin/python" -m pip install --disable-pip-version-check -q "$PIP_TOOLS" 2>&1 \
    | { grep -v "^WARNING: Location" || true; } \
    || { echo "ERROR: could not install $PIP_TOOLS into $tools" >&2; exit 1; }
fi
# compile FILE ARGS...: pip-compile pyproject.toml into FILE, with no index, host or local path
compile() {
  local out=$1
  shift
  CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" "$tools/bin/pip-compile" -q \
    --no-emit-index-url --no-emit-find-links --no-emit-trusted-host --strip-extras \
    --annotation-style line --unsafe-package torch --no-allow-unsafe -c requirements/torch.txt \
    -o "$out.new" "$@" pyproject.toml 2>&1 | { grep -v "^WARNING: Location" || true; } \
    || { echo "ERROR: pip-compile could not write $out" >&2; exit 1; }
  # torch is installed first from requirements/torch.txt: say so where pip-compile names it
  local kept="# kept out (installed first, from requirements\/torch.txt):"
  sed -i -e "s/^# The following packages are considered to be unsafe.*/$kept/" \
    -e 's/ -c requirements\/[a-z-]*\.txt,//' "$out.new"
  # a CUDA package means pip resolved torch 2.13.0 to a CUDA wheel, not the CPU one
  if grep -n -i -E '://|^ *--|^/|nvidia|cuda|^torch=' "$out.new"; then
    echo "ERROR: $out would name an index, a local path or a CUDA package (lines above)" >&2
    exit 1
  fi
  mv "$out.new" "$out"
  echo "wrote $out: $(grep -c '==' "$out") pinned packages"
}
rm -f requirements/lock.txt.new requirements/lock-runtime.txt.new
compile requirements/lock.txt --upgrade --extra test --extra ray "$@"
# the runtime subset, constrained to the full lock's versions
compile requirements/lock-runtime.txt --upgrade -c requirements/lock.txt
