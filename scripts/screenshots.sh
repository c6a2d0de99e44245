#!/usr/bin/env bash
# Opt-in (not part of .ci/run): renders the HTML reports of the demo, of a
# sweep and of the reference runtime's invariance matrix in headless Chromium and saves PNG screenshots.
#
#   scripts/screenshots.sh [OUT_DIR]      (default: docs/img)
#
# Needs Debian's `chromium` package; installs it with apt-get when missing
# (root). Everything runs offline: the reports have no external references.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/img}"
mkdir -p "$out"

if ! command -v chromium >/dev/null 2>&1; then
  echo "installing chromium (Debian package) ..." >&2
  apt-get install -y chromium >/dev/null
fi

cargo build --release -p moeconf
bin="$PWD/target/release/moeconf"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$bin" demo --out-dir "$work/demo" >/dev/null
"$bin" sweep --prompt "why the sheep" --scheme b --max-new-tokens 8 -q --html "$work/sweep.html" >/dev/null
"$bin" invariance --preset reference --out "$work/invariance" -q >/dev/null

shot() { # shot HTML PNG HEIGHT
  # The flags keep Chromium off the network (this machine has none) and
  # reproducible: no GPU, no background services, a fresh profile.
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --hide-scrollbars --user-data-dir="$work/profile" --window-size="1280,$3" \
    --screenshot="$2" "file://$1" >/dev/null 2>&1
  echo "wrote $2"
}
shot "$work/demo/report.html" "$out/demo-report.png" 1000
shot "$work/sweep.html" "$out/sweep-report.png" 900
shot "$work/invariance/index.html" "$out/invariance-report.png" 700
