#!/usr/bin/env bash
# Opt-in: decode speed of the reference runtime against transformers on the built-in fixture,
# both measured in one run (python/bench_transformers.py; docs/performance.md, "Against
# transformers"). Installs the same pinned heavy stack as python/run_interop.sh (torch 2.15.0,
# transformers 5.23.0, safetensors 0.8.0) into a virtual environment outside the repository,
# $MOECONF_TORCH_VENV (default ~/.cache/moeconf/venv-torch), reused when it already has the
# pins, builds the Rust binary if it is missing, and prints both speeds and their ratio.
# Not part of the default CI run (.ci/run). Extra arguments go to bench_transformers.py
# (e.g. --tokens 200 --repeat 3).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${MOECONF_TORCH_VENV:-$HOME/.cache/moeconf/venv-torch}"
PINS=("torch==2.15.0" "transformers==5.23.0" "safetensors==0.8.0")
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if ! "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
want = {"torch": "2.15.0", "transformers": "5.23.0", "safetensors": "0.8.0"}
sys.exit(0 if all(m.version(k).split("+")[0] == v for k, v in want.items()) else 1)
PY
then
  PIP_ROOT_USER_ACTION=ignore "$VENV/bin/python" -m pip install --disable-pip-version-check "${PINS[@]}" numpy
fi
BIN="${MOECONF_BIN:-../target/release/moeconf}"
if [ ! -x "$BIN" ]; then
  (cd .. && cargo build --release -p moeconf)
fi
MOECONF_BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
export MOECONF_BIN
exec "$VENV/bin/python" bench_transformers.py "$@"
