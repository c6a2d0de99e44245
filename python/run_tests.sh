#!/usr/bin/env bash
# Runs the Python package's tests (python/tests) for CI.
#
# Installs numpy, blake3, pytest and gguf (pure Python: the GGUF reader and
# quantizers the llama.cpp export is checked against, tests/test_llamacpp.py)
# with pip when they are missing (a no-op when they are already installed),
# then runs pytest. Tests that need the
# Rust binary use $MOECONF_BIN or target/release/moeconf (CI builds it first
# with `cargo build --release -p moeconf`); without it they skip with a note.
# Exit code: 0 on success, non-zero on any failure, including "no tests
# collected" (pytest exit 5), which here means the test files went missing.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "run_tests.sh: $PYTHON not found (the Python tests need python3 >= 3.9)" >&2
  exit 2
fi
if ! "$PYTHON" -c "import numpy, blake3, pytest, gguf" >/dev/null 2>&1; then
  echo "== pip install numpy blake3 pytest gguf==0.19.0"
  PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --disable-pip-version-check \
    numpy blake3 pytest "gguf==0.19.0"
fi

echo "== pytest python/tests"
set +e
"$PYTHON" -m pytest -q -p no:cacheprovider tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "run_tests.sh: pytest collected no tests (exit 5): python/tests is missing or empty" >&2
  exit 1
fi
exit "$rc"
