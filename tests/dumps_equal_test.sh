#!/usr/bin/env bash
# scripts/dumps_equal.py, which the GPU check compares a CUDA load's dump with a
# host load's by: equal when only the metadata's device name differs (as "host:0"
# against "cuda:0" does), unequal for one flipped byte of a tensor, a missing file.
# Usage: dumps_equal_test.sh FERRY
set -euo pipefail
ferry=$1
src=$(cd "$(dirname "$0")/.." && pwd)
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
"$ferry" synth --family llama --preset tiny --out "$d/ck" >/dev/null
"$ferry" load --model "$d/ck" --quiet --dump-dir "$d/a" >/dev/null
cp -r "$d/a" "$d/b"
python3 - "$d/b/rank-0.safetensors" <<'PY'
import sys
p = sys.argv[1]
raw = open(p, "rb").read()
assert b'"host:0"' in raw
open(p, "wb").write(raw.replace(b'"host:0"', b'"cuda:0"'))
PY
python3 "$src/scripts/dumps_equal.py" "$d/a" "$d/b" || { echo "a device name made a difference"; exit 1; }
python3 - "$d/b/rank-0.safetensors" <<'PY'
import sys
p = sys.argv[1]
raw = bytearray(open(p, "rb").read())
raw[-3] ^= 1
open(p, "wb").write(raw)
PY
if python3 "$src/scripts/dumps_equal.py" "$d/a" "$d/b"; then echo "a flipped byte went unseen"; exit 1; fi
rm "$d/b/rank-0.safetensors"
if python3 "$src/scripts/dumps_equal.py" "$d/a" "$d/b"; then echo "a missing file went unseen"; exit 1; fi
echo "dumps_equal_test: ok"
