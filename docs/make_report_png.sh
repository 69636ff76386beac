#!/usr/bin/env bash
# Re-creates docs/report.png: the top of the HTML report of `llama-parity compare` (no
# arguments: jaxmodel vs torchref on SmolLM2 at fp32), rendered by headless Chromium
# (Debian: apt-get install chromium) and quantised to a small palette PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/llama-parity compare --no-colour --out-dir "$work" > "$work/table.txt"
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$work/chromium" --hide-scrollbars --window-size=1150,1720 \
  --screenshot="$work/report.png" "file://$work/jaxmodel-vs-torchref-fp32.html"
.venv/bin/python -c "
from PIL import Image
Image.open('$work/report.png').convert('RGB').quantize(colors=64).save('docs/report.png', optimize=True)"
echo "docs/report.png written; the terminal table was:"
cat "$work/table.txt"
