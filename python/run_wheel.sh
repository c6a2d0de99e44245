#!/usr/bin/env bash
# Builds the moeconf wheel (the Rust binary and the Python package in one, maturin with
# bindings = "bin": ../pyproject.toml) and checks it in a fresh virtual environment that has
# only that wheel (and its dependencies numpy and blake3) installed and no Rust toolchain on
# PATH: `moeconf --version`, `python -c "import moeconf"` holding the binary to the package
# (`python3 -m moeconf binary`), `moeconf demo` to its last line, and the generic capture end to
# end without torch (python/examples/generic_capture.py: a numpy toy MoE traced through
# moeconf.torch twice and diffed, docs/capture.md §6). CI runs it (.ci/run).
#
# Usage: python/run_wheel.sh [--out DIR]     (DIR keeps the built wheel; default: a temporary
#                                             directory removed at the end)
# Needs: cargo (to build), python3 >= 3.9 with venv, PyPI for maturin/numpy/blake3 (cached
# under ${MOECONF_CACHE:-$HOME/.cache/moeconf}). Exit 0 when every check passes, 1 when one
# fails, 2 on a usage or set-up error.
set -euo pipefail
CALLER="$PWD"
cd "$(dirname "$0")/.."
REPO="$PWD"
setup_fail() { echo "run_wheel.sh: set-up failed: $*" >&2; exit 2; }

MATURIN_VERSION="1.16.0"
PYTHON="${PYTHON:-python3}"
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="${2:?--out needs a directory}"; shift 2
           case "$OUT" in /*) ;; *) OUT="$CALLER/$OUT" ;; esac ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_wheel.sh: unknown argument $1 (--out DIR)" >&2; exit 2 ;;
  esac
done
command -v cargo >/dev/null 2>&1 || { echo "run_wheel.sh: cargo not found (building the wheel needs Rust)" >&2; exit 2; }
command -v "$PYTHON" >/dev/null 2>&1 || { echo "run_wheel.sh: $PYTHON not found" >&2; exit 2; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/moeconf-wheel.XXXXXX")"
BUILD_INFO="$REPO/python/moeconf/_build.py"
trap 'rm -rf "$WORK" "$BUILD_INFO"' EXIT
DIST="${OUT:-$WORK/dist}"
mkdir -p "$DIST"

CACHE="${MOECONF_CACHE:-$HOME/.cache/moeconf}"
BUILD_VENV="$CACHE/venv-maturin-$MATURIN_VERSION"
if ! "$BUILD_VENV/bin/maturin" --version >/dev/null 2>&1; then
  echo "== build environment: maturin==$MATURIN_VERSION in $BUILD_VENV"
  rm -rf "$BUILD_VENV"
  "$PYTHON" -m venv "$BUILD_VENV" || setup_fail "python3 -m venv $BUILD_VENV"
  PIP_ROOT_USER_ACTION=ignore "$BUILD_VENV/bin/pip" install --quiet --disable-pip-version-check \
    "maturin==$MATURIN_VERSION" || setup_fail "pip install maturin==$MATURIN_VERSION"
fi

# The commit goes into the wheel's package too, so that `python3 -m moeconf binary` holds the
# binary to the same commit, not only the same release (removed again when the script ends).
COMMIT="$(git -C "$REPO" rev-parse HEAD 2>/dev/null || true)"
if [ -n "$COMMIT" ]; then
  printf '"""Written by python/run_wheel.sh into the wheel: the commit it was built from."""\nCOMMIT = "%s"\n' \
    "$COMMIT" > "$BUILD_INFO"
fi

echo "== maturin build --release (binary from cli/, package from python/moeconf)"
rm -f "$DIST"/moeconf-*.whl
"$BUILD_VENV/bin/maturin" build --release --out "$DIST" 2>&1 | grep -v '^ *\(Compiling\|Downloaded\|Downloading\)' || true
WHEELS=("$DIST"/moeconf-*.whl)
if [ "${#WHEELS[@]}" -ne 1 ] || [ ! -f "${WHEELS[0]}" ]; then
  echo "run_wheel.sh: expected one wheel in $DIST, found: ${WHEELS[*]}" >&2
  exit 1
fi
WHEEL="${WHEELS[0]}"
echo "wheel: $WHEEL ($(du -h "$WHEEL" | cut -f1))"

echo "== fresh virtual environment with only the wheel"
"$PYTHON" -m venv "$WORK/venv" || setup_fail "python3 -m venv $WORK/venv"
PIP_ROOT_USER_ACTION=ignore "$WORK/venv/bin/pip" install --quiet --disable-pip-version-check "$WHEEL" \
  || setup_fail "pip install of the wheel (and numpy, blake3 from PyPI)"

# The checks run with the venv first on PATH, no cargo/rustc, outside the repository (so
# `import moeconf` is the installed package, not python/moeconf).
CHECK_PATH="$WORK/venv/bin:/usr/local/bin:/usr/bin:/bin"
RUN=(env -i "PATH=$CHECK_PATH" "HOME=$WORK/home" "MOECONF_CACHE_DIR=$WORK/cache" "LANG=C.UTF-8" "NO_COLOR=1")
mkdir -p "$WORK/home" "$WORK/run"
cd "$WORK/run"
fail() { echo "run_wheel.sh: FAIL: $*" >&2; exit 1; }

if RUST_FOUND="$("${RUN[@]}" sh -c 'command -v cargo || command -v rustc')"; then
  # A system-wide toolchain cannot be taken off PATH; nothing below calls it.
  echo "run_wheel.sh: note: $RUST_FOUND is on the check PATH ($CHECK_PATH); the checks do not use it" >&2
fi
[ "$("${RUN[@]}" sh -c 'command -v moeconf')" = "$WORK/venv/bin/moeconf" ] || fail "moeconf on PATH is not the wheel's"

echo "== moeconf --version"
"${RUN[@]}" moeconf --version || fail "moeconf --version"

echo "== python -c 'import moeconf' (the installed package, held to the binary)"
"${RUN[@]}" python -c 'import moeconf, os; print("moeconf", moeconf.__version__, "from", os.path.dirname(moeconf.__file__))' \
  || fail "import moeconf"
"${RUN[@]}" python -c 'import moeconf, sys; sys.exit(0 if "site-packages" in moeconf.__file__ else 1)' \
  || fail "import moeconf did not import the installed package"
"${RUN[@]}" python -m moeconf binary || fail "python -m moeconf binary: the binary does not fit the package"
if [ -n "$COMMIT" ]; then
  "${RUN[@]}" python -c 'import sys; from moeconf import binary; sys.exit(0 if binary.package_commit() == sys.argv[1] else 1)' \
    "$COMMIT" || fail "the wheel's package does not name commit $COMMIT"
fi

echo "== moeconf demo"
"${RUN[@]}" moeconf demo > demo.txt 2> demo.err || { cat demo.err >&2; fail "moeconf demo exited non-zero"; }
tail -n 3 demo.txt
grep -q '^first divergence: L4 step 1 position 5 layer 5 operator moe.combine' demo.txt || fail "moeconf demo: no first-divergence line"
tail -n 1 demo.txt | grep -q '^The demo worked' || fail "moeconf demo: its last line is not the normal one"
[ -s moeconf-demo/report.html ] || fail "moeconf demo: no report.html"

echo "== generic capture end to end (python/examples/generic_capture.py: numpy toy, moeconf.torch, diff)"
"${RUN[@]}" python "$REPO/python/examples/generic_capture.py" --out "$WORK/run/example" || fail "the generic capture example"

echo "run_wheel.sh: OK: $(basename "$WHEEL") installs the moeconf command and package; demo, --version, import, the binary check and the generic capture pass without Rust"
