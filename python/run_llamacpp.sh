#!/usr/bin/env bash
# The one command for llama.cpp as a second backend (docs/interop-llamacpp.md): installs the
# pinned stack into a virtual environment outside the repository (reused when it already holds
# it), builds the Rust binary if it is missing, runs the llama.cpp tests (the unit tests and the
# opt-in live ones, MOECONF_LLAMACPP_TESTS=1), then python/llamacpp_report.py, which exports the
# GGUFs, captures llama.cpp, runs the reference, diffs, explains, replays and gates, and prints
# every number of docs/interop-llamacpp.md section 4. Traces and GGUFs stay in $LLAMACPP_OUT
# (default target/llamacpp). Then the invariance step: llama.cpp under a matrix of its own settings
# (moeconf invariance python/invariance/llamacpp.toml, and the same matrix with flash attention off,
# python/invariance/llamacpp-fa-off.toml; docs/invariance.md section 5.1), each matrix printed and
# its first divergences recomputed bit for bit (python/llamacpp_invariance.py). Not part of the
# default CI run (.ci/run).
#
#   LLAMACPP_VENV   the virtual environment (default $HOME/.cache/moeconf/venv-llamacpp); an
#                   existing one holding llama-cpp-python 0.3.36 and gguf is reused as is
#   LLAMACPP_OUT    output directory
#   MOECONF_BIN     the moeconf binary (default target/release/moeconf, built when missing)
#   LLAMACPP_STEPS  which steps to run (default "tests report invariance"; e.g. LLAMACPP_STEPS=invariance
#                   runs the matrices alone, about 8 minutes here)
#   LLAMACPP_CMAKE_ARGS  build llama-cpp-python with these CMAKE_ARGS instead of the native ones, to
#                   force another CPU code path than this machine's, e.g. AVX2 on an AVX-512 machine:
#                   "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_FMA=ON -DGGML_F16C=ON
#                   -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=ON" (use a venv of its own; pip's
#                   wheel cache is bypassed, so a wheel built for another path is never reused)
#
# Building llama-cpp-python 0.3.36 from source takes about 6 minutes on two idle cores (CPU only:
# CMAKE_ARGS below; pip brings cmake and ninja); pip caches the built wheel, so a new venv reuses it.
#
# The report and the matrices are printed even when a test fails; the exit status is then non-zero
# (the tests', the report's or the invariance step's, whichever failed first). A matrix that finds
# configurations which are not invariant is a measurement, not a failure (moeconf invariance exit 1
# is accepted); only an error (exit 2: a configuration without a verdict) fails the step.
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
  cmake_args="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=ON"
  cache=()
  if [ -n "${LLAMACPP_CMAKE_ARGS:-}" ]; then
    cmake_args="$LLAMACPP_CMAKE_ARGS"
    cache=(--no-cache-dir)
  fi
  echo "== CMAKE_ARGS=$cmake_args"
  CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    PIP_ROOT_USER_ACTION=ignore nice -n 5 "$VENV/bin/pip" install --disable-pip-version-check ${cache[@]+"${cache[@]}"} "${PINS[@]}"
fi
PY="$VENV/bin/python"
BIN="${MOECONF_BIN:-../target/release/moeconf}"
if [ ! -x "$BIN" ]; then
  (cd .. && cargo build --release -p moeconf)
fi
MOECONF_BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
export MOECONF_BIN
# The CPU and the code path llama.cpp was compiled for (the numbers of the report depend on both).
echo "== CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //') ($(nproc) cores)"
"$PY" -c 'import llama_cpp; print("== llama.cpp CPU backend:", llama_cpp.llama_print_system_info().decode().strip())' \
  || echo "== llama.cpp CPU backend: unknown"
STEPS="${LLAMACPP_STEPS:-tests report invariance}"
OUT="${LLAMACPP_OUT:-../target/llamacpp}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
tests_rc=0 report_rc=0 inv_rc=0
set +e
if [[ " $STEPS " == *" tests "* ]]; then
  MOECONF_LLAMACPP_TESTS=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_llamacpp.py tests/test_llamacpp_live.py \
    tests/test_llamacpp_hc_pre.py tests/test_llamacpp_invariance.py
  tests_rc=$?
fi
if [[ " $STEPS " == *" report "* ]]; then
  "$PY" llamacpp_report.py --out "$OUT"
  report_rc=$?
fi
if [[ " $STEPS " == *" invariance "* ]]; then
  # The matrices' --model: a directory holding the native GGUF and the checkpoint it was exported from.
  model="$OUT/invariance-model"
  mkdir -p "$model"
  echo "== invariance: exporting the native GGUF of builtin:tiny-v4-fp8 into $model"
  MOECONF_CACHE_DIR="$OUT/cache" "$MOECONF_BIN" export gguf --model builtin:tiny-v4-fp8 --type native \
    -o "$model/native.gguf" >/dev/null
  inv_rc=$?
  ckpt=$(ls -d "$OUT"/cache/tiny-v4-fp8-[0-9]* 2>/dev/null | head -1)
  if [ "$inv_rc" -ne 0 ] || [ -z "$ckpt" ]; then
    echo "run_llamacpp.sh: could not export the GGUF for the invariance matrices" >&2
    inv_rc=2
  else
    ln -sfn "$ckpt" "$model/checkpoint"
    for m in llamacpp llamacpp-fa-off; do
      echo "== moeconf invariance invariance/$m.toml --model $model --out $OUT/invariance-$m"
      PATH="$VENV/bin:$PATH" PYTHONPATH="$PWD" nice -n 5 "$MOECONF_BIN" invariance "invariance/$m.toml" \
        --model "$model" --out "$OUT/invariance-$m"
      rc=$?
      if [ "$rc" -ge 2 ]; then
        echo "run_llamacpp.sh: moeconf invariance invariance/$m.toml ended with an error (exit $rc)" >&2
        [ "$inv_rc" -eq 0 ] && inv_rc=$rc
        continue
      fi
      echo "== the first divergences recomputed (python/llamacpp_invariance.py)"
      "$PY" llamacpp_invariance.py --gguf "$model/native.gguf" --matrix "$OUT/invariance-$m"
      rc=$?
      [ "$rc" -ne 0 ] && [ "$inv_rc" -eq 0 ] && inv_rc=$rc
    done
  fi
fi
set -e
if [ "$tests_rc" -ne 0 ]; then
  echo "run_llamacpp.sh: the llama.cpp tests failed (pytest exit $tests_rc); the report above was printed anyway" >&2
  exit "$tests_rc"
fi
[ "$report_rc" -ne 0 ] && exit "$report_rc"
exit "$inv_rc"
