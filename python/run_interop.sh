#!/usr/bin/env bash
# The one command for the opt-in transformers tests and the measured cross-backend report
# (docs/interop.md). Installs the pinned heavy stack from PyPI (torch 2.15.0 CPU+CUDA wheels,
# transformers 5.23.0, safetensors 0.8.0: about 5.6 GB), builds the Rust binary if it is
# missing, runs the `transformers`-marked tests (MOECONF_TRANSFORMERS_TESTS=1), then
# python/interop_check.py (8 and 40 new tokens) and python/interop_experts.py (every experts
# implementation in fp32 and bf16), which print every number of docs/interop.md, then the
# transformers invariance matrix (python/invariance/transformers.toml, docs/invariance.md section 5.2)
# and python/invariance_transformers.py, and leaves the traces in $INTEROP_OUT (default
# target/interop). Not part of the default CI run (.ci/run).
#
# The tests assert structural properties that hold on any CPU; the numbers the report prints
# depend on torch's CPU kernels (docs/interop.md names the CPU and torch capability of each
# measurement). The report is printed even when tests fail; the exit code is then non-zero.
# To measure torch's other x86 code path: ATEN_CPU_CAPABILITY=avx2 (or default, avx512).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --disable-pip-version-check \
  "torch==2.15.0" "transformers==5.23.0" "safetensors==0.8.0" numpy blake3 pytest
BIN="${MOECONF_BIN:-../target/release/moeconf}"
if [ ! -x "$BIN" ]; then
  (cd .. && cargo build --release -p moeconf)
fi
MOECONF_BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
export MOECONF_BIN
"$PYTHON" -c 'import platform, torch
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor()) \
    if platform.system() == "Linux" else platform.processor()
print(f"== CPU: {cpu}; torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")'
failed=()
set +e
MOECONF_TRANSFORMERS_TESTS=1 "$PYTHON" -m pytest -q -rxX -p no:cacheprovider -m transformers tests
rc=$?
[ "$rc" -eq 0 ] || failed+=("pytest -m transformers (exit $rc)")
OUT="${INTEROP_OUT:-../target/interop}"
"$PYTHON" interop_check.py --out "$OUT/steps8"                 # docs/interop.md sections 2-4.3
rc=$?; [ "$rc" -eq 0 ] || failed+=("interop_check.py --steps 8 (exit $rc)")
"$PYTHON" interop_check.py --out "$OUT/steps40" --steps 40     # section 4.4 (every feature active)
rc=$?; [ "$rc" -eq 0 ] || failed+=("interop_check.py --steps 40 (exit $rc)")
"$PYTHON" interop_experts.py --out "$OUT/experts"               # sections 4.5-4.6: eager / grouped_mm / batched_mm x fp32 / bf16 (diff, explain, replay)
rc=$?; [ "$rc" -eq 0 ] || failed+=("interop_experts.py (exit $rc)")
# docs/invariance.md section 5.2: transformers under its serving settings (threads, batch composition and
# padding side, experts implementation), each configuration captured by `python3 -m moeconf transformers`
# and bisected against the base. Every knob is declared `info`, so a non-invariance is reported, not
# failed: only exit 2 (a configuration without a verdict, a bad matrix) fails this step.
INV="$OUT/invariance"
mkdir -p "$INV"
# the built-in fixture's BF16 checkpoint, materialized by a one-token run into a private cache
MOECONF_CACHE_DIR="$INV/cache" "$MOECONF_BIN" run --model builtin:tiny-v4 --prompt "why the sheep" \
  --max-new-tokens 1 --capture L0 -o "$INV/fixture.bin" >/dev/null
MODEL_DIR="$(dirname "$(ls -d "$INV"/cache/tiny-v4-*/config.json 2>/dev/null | head -n 1)")"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  failed+=("materializing builtin:tiny-v4 for the invariance matrix")
else
  # the matrix's command runs `python3 -m moeconf`: this package, with $PYTHON's interpreter first on PATH
  PATH="$(dirname "$(command -v "$PYTHON")"):$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$MOECONF_BIN" invariance invariance/transformers.toml --model "$MODEL_DIR" --out "$INV/matrix"
  rc=$?
  if [ "$rc" -eq 2 ]; then
    failed+=("moeconf invariance invariance/transformers.toml (exit 2)")
  else
    "$PYTHON" invariance_transformers.py --out "$INV/matrix" --model "$MODEL_DIR"   # divergences, recomputed both ways
    rc=$?; [ "$rc" -eq 0 ] || failed+=("invariance_transformers.py (exit $rc)")
  fi
fi
set -e
if [ "${#failed[@]}" -gt 0 ]; then
  printf 'run_interop.sh: FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "run_interop.sh: every test passed and every report step completed"
