#!/usr/bin/env bash
# The packed GPU check without a GPU: scripts/gpu-pack.sh packs this CUDA build
# (FERRY_GPU_BUILD, no second compile) into a temporary folder, and
# scripts/gpu-check.sh runs from it: the packed libraries resolve (the non-system
# ones from the pack), a host load of the packed checkpoint works, and every GPU
# step is skipped with a message. Where a GPU is present the check runs in full
# and must pass. Usage: gpu_pack_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail() {
  echo "gpu_pack_test: $*" >&2
  exit 1
}

FERRY_GPU_BUILD="$build" FERRY_GPU_PACK="$d/pack" bash "$src/scripts/gpu-pack.sh"
for f in bin/ferry bin/ferry_gpu_tests ck-llama/config.json ck-deepseek/config.json COMMIT; do
  [ -e "$d/pack/$f" ] || fail "the pack has no $f"
done
# The libraries the GPU machine lacks resolve from the pack, the C library does not.
resolved=$(LD_LIBRARY_PATH="$d/pack/lib" ldd "$d/pack/bin/ferry")
for lib in libcaf_core liburing libprometheus-cpp-core libstdc++; do
  grep -q "$lib[^ ]* => $d/pack/lib/" <<<"$resolved" || fail "$lib does not come from the pack:
$resolved"
done
if grep -q "libc\.so[^ ]* => $d/pack" <<<"$resolved"; then
  fail "the pack carries the C library"
fi
[ ! -e "$d/pack/lib/libcuda.so.1" ] || fail "the pack carries the driver library"

status=0
OUT="$d/out" FERRY_GPU_PACK="$d/pack" bash "$src/scripts/gpu-check.sh" || status=$?
cat "$d/out/summary.txt"
[ "$status" -eq 0 ] || fail "gpu-check.sh reported $status failed step(s)"
grep -q '^ok      the packed libraries resolve' "$d/out/summary.txt" || fail "no library step"
grep -q '^ok      host load of the packed checkpoint' "$d/out/summary.txt" || fail "no host load"
[ -s "$d/out/host-load.json" ] || fail "the host load wrote no report"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  grep -q '^skipped every GPU step: nvidia-smi finds no GPU here' "$d/out/summary.txt" ||
    fail "the GPU steps were not skipped with a message"
fi
echo "gpu_pack_test: ok"
