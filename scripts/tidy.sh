#!/usr/bin/env bash
# Runs clang-tidy (Debian's clang-tidy-14, .clang-tidy at the root) over the C++
# sources of ferry's libraries and tools that changed since BASE (default: the
# last commit, HEAD~1), using the compile_commands.json of build/asan, else of
# build/debug (configure one first: bash scripts/test.sh configures build/asan).
# Tests and CUDA sources are left out: gtest's macros and nvcc's flags only add
# noise. Exit status: 1 when any warning was found, 0 otherwise.
#
#   bash scripts/tidy.sh            # what the last commit changed
#   bash scripts/tidy.sh main~5     # what changed since main~5
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-HEAD~1}
tidy=$(command -v clang-tidy-14 || command -v clang-tidy || true)
if [ -z "$tidy" ]; then
  echo "tidy: no clang-tidy here (apt-get install clang-tidy-14)" >&2
  exit 2
fi
db=
for dir in build/asan build/debug; do
  if [ -f "$dir/compile_commands.json" ]; then
    db=$dir
    break
  fi
done
if [ -z "$db" ]; then
  echo "tidy: no build/asan or build/debug compile_commands.json: configure a Debug build first" >&2
  exit 2
fi
mapfile -t files < <(git diff --name-only --diff-filter=ACMR "$base" -- \
  'actors/*.cpp' 'common/*.cpp' 'gpu/*.cpp' 'io/*.cpp' 'models/*.cpp' 'runtime/*.cpp' \
  'tools/*.cpp' | sort -u)
if [ "${#files[@]}" -eq 0 ]; then
  echo "tidy: no changed library sources since $base"
  exit 0
fi
echo "tidy: ${#files[@]} file(s) changed since $base"
out=$("$tidy" -p "$db" --quiet "${files[@]}" 2>/dev/null || true)
warnings=$(grep -c ': warning: ' <<<"$out" || true)
[ -z "$out" ] || echo "$out"
echo "tidy: $warnings warning(s)"
[ "$warnings" -eq 0 ]
