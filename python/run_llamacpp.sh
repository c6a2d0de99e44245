#!/usr/bin/env bash
# The one command for llama.cpp as a second backend (docs/interop-llamacpp.md): installs the
# pinned stack into a virtual environment outside the repository (reused when it already holds
# it), builds the Rust binary if it is missing, runs the llama.cpp tests (the unit tests and the
# opt-in live ones, MOECONF_LLAMACPP_TESTS=1), then python/llamacpp_report.py, which exports the
# GGUFs, captures llama.cpp, runs the reference, diffs, explains, replays and gates, and prints
# every number of docs/interop-llamacpp.md section 4. Traces and GGUFs stay in $LLAMACPP_OUT
# (default target/llamacpp). Not part of the default CI run (.ci/run).
#
#   LLAMACPP_VENV   the virtual environment (default $HOME/.cache/moeconf/venv-llamacpp); an
#                   existing one holding llama-cpp-python 0.3.36 and gguf is reused as is
#   LLAMACPP_OUT    output directory
#   MOECONF_BIN     the moeconf binary (default target/release/moeconf, built when missing)
#
# Building llama-cpp-python 0.3.36 from source takes about 6 minutes on two idle cores (CPU only:
# CMAKE_ARGS below; pip brings cmake and ninja); pip caches the built wheel, so a new venv reuses it.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${LLAMACPP_VENV:-$HOME/.cache/moeconf/venv-llamacpp}"
PINS=("llama-cpp-python==0.3.36" "gguf==0.19.0" numpy blake3 pytest)
check='import sys, llama_cpp, gguf, numpy, blake3, pytest; sys.exit(0 if llama_cpp.__version__ == "0.3.36" else 1)'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "== reusing $VENV"
else
  echo "== installing ${PINS[*]} into $VENV"
  python3 -m venv "$VENV"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    PIP_ROOT_USER_ACTION=ignore nice -n 5 "$VENV/bin/pip" install --disable-pip-version-check "${PINS[@]}"
fi
PY="$VENV/bin/python"
BIN="${MOECONF_BIN:-../target/release/moeconf}"
if [ ! -x "$BIN" ]; then
  (cd .. && cargo build --release -p moeconf)
fi
MOECONF_BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
export MOECONF_BIN
MOECONF_LLAMACPP_TESTS=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_llamacpp.py tests/test_llamacpp_live.py
"$PY" llamacpp_report.py --out "${LLAMACPP_OUT:-../target/llamacpp}"
