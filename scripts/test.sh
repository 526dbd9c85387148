#!/usr/bin/env bash
# The README's second command (and CI's): build every target in Debug and in
# Release, warnings as errors, the CUDA backend too where the toolkit exists, and
# run every test in both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
jobs=$(nproc)
for type in Debug Release; do
  dir=build/$(echo "$type" | tr '[:upper:]' '[:lower:]')
  echo "== $type build in $dir"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="$type" >/dev/null
  cmake --build "$dir" -j "$jobs"
done
for type in Debug Release; do
  dir=build/$(echo "$type" | tr '[:upper:]' '[:lower:]')
  echo "== $type tests"
  ctest --test-dir "$dir" --output-on-failure -j "$jobs"
done
