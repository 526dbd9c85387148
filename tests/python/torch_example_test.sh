#!/usr/bin/env bash
# examples/python/torch_adopt.py on a synthesized checkpoint at tp 2:
#   torch_example_test.sh FERRY_CLI MODULE_DIR PYTHON SOURCE_DIR
# with torch from the bench venv (scripts/bench-venv.sh) when its Python is
# PYTHON's version, else PYTHON itself; the example exits 77 (skipped) without torch.
set -euo pipefail
cli=$1 module=$2 py=$3 src=$4
version() { "$1" -c 'import sys; print(sys.version_info[:2])'; }
venv=$src/.venv-bench/bin/python
if [ -x "$venv" ] && [ "$(version "$venv")" = "$(version "$py")" ]; then
  py=$venv
fi
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
"$cli" synth --family llama --preset tiny --out "$d/ck" >/dev/null
PYTHONPATH=$module "$py" "$src/examples/python/torch_adopt.py" "$d/ck" 2
