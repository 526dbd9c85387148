#!/usr/bin/env bash
# The packed GPU check without a GPU: scripts/gpu-pack.sh packs this CUDA build
# (FERRY_GPU_BUILD, no second compile) into a temporary folder, and
# scripts/gpu-check.sh runs from it. Checked here:
#   - --plan lists every step with a limit, the total is at most 240 s, and it runs
#     nothing;
#   - the packed binaries carry RUNPATH $ORIGIN/../lib, load no libcudart.so, and
#     resolve the non-system libraries from the pack with LD_LIBRARY_PATH unset;
#   - the throughput checkpoint gpu-check.sh synthesizes holds at least 16 GiB (its
#     header only, written sparse);
#   - the check passes with every GPU step skipped, summary.txt starting with the
#     device, driver, commit and figure lines ("not measured (no GPU)");
#   - with a stand-in nvidia-smi claiming a GPU, the CUDA selftest fails and every
#     later CUDA step is skipped saying why (stop early), exit status 1.
# Where a GPU is present the check runs in full and must pass.
# Usage: gpu_pack_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail() {
  echo "gpu_pack_test: $*" >&2
  exit 1
}
has_gpu() { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }

# ---- the plan ----------------------------------------------------------------------
plan=$(OUT="$d/plan-out" bash "$src/scripts/gpu-check.sh" --plan) || fail "--plan failed:
$plan"
echo "$plan"
[ ! -e "$d/plan-out" ] || fail "--plan wrote into \$OUT: it must run nothing"
# Each step row is "N LIMIT s TITLE"; every step function of the script is one row.
rows=$(grep -cE '^ *[0-9]+ +[0-9]+ s  ' <<<"$plan")
steps=$(grep -cE '^  "[0-9]+\|[^|]*\|[^|]*\|[a-z0-9_]+\|' "$src/scripts/gpu-check.sh")
if [ "$rows" -ne "$steps" ] || [ "$rows" -lt 10 ]; then
  fail "--plan lists $rows steps, the script's table has $steps"
fi
sum=$(awk '/^ *[0-9]+ +[0-9]+ s  / { s += $2 } END { print s }' <<<"$plan")
total=$(sed -nE 's/^total ([0-9]+) s .*/\1/p' <<<"$plan")
[ "$sum" = "$total" ] || fail "the step limits add up to $sum s, --plan says $total"
[ "$total" -le 240 ] || fail "the step limits add up to $total s, over the 240 s budget"
for title in "ferry selftest --devices cuda" "pinned H2D" "compute-sanitizer memcheck" \
  "the SGLang path" "ferry_gpu_tests"; do
  grep -q -- "$title" <<<"$plan" || fail "--plan has no step '$title'"
done
# The order that answers the most first: selftest, then the throughput, the
# optional steps last.
line_of() { grep -n -m1 -- "$1" <<<"$plan" | cut -d: -f1; }
previous=0
for title in 'libraries resolve' 'host load' 'selftest' 'cuda = host: the packed Llama' \
  'pinned H2D' 'ferry: the' 'the SGLang path' 'compute-sanitizer' 'ferry_gpu_tests'; do
  at=$(line_of "$title")
  if [ "$at" -le "$previous" ]; then
    fail "the steps are out of order at '$title'"
  fi
  previous=$at
done

# ---- the pack ----------------------------------------------------------------------
FERRY_GPU_BUILD="$build" FERRY_GPU_PACK="$d/pack" bash "$src/scripts/gpu-pack.sh"
for f in bin/ferry bin/ferry_gpu_tests ck-llama/config.json ck-deepseek/config.json \
  big-config.json COMMIT; do
  [ -e "$d/pack/$f" ] || fail "the pack has no $f"
done
for bin in ferry ferry_gpu_tests; do
  # shellcheck disable=SC2016  # $ORIGIN is the loader's
  dynamic=$(readelf -d "$d/pack/bin/$bin")  # whole: `readelf | grep -q` races under pipefail
  grep -q 'RUNPATH.*\[\$ORIGIN/\.\./lib\]' <<<"$dynamic" ||
    fail "bin/$bin has no RUNPATH \$ORIGIN/../lib: $(readelf -d "$d/pack/bin/$bin" | grep -i path)"
  resolved=$(env -u LD_LIBRARY_PATH ldd "$d/pack/bin/$bin")
  if grep -q 'libcudart\.so' <<<"$resolved"; then
    fail "bin/$bin loads libcudart.so (the CUDA runtime must be linked statically)"
  fi
  if grep -q "not found" <<<"$resolved"; then
    fail "bin/$bin does not resolve:
$resolved"
  fi
done
if env -u LD_LIBRARY_PATH ldd "$build/ferry" | grep -q 'libcudart\.so'; then
  fail "$build/ferry loads libcudart.so"
fi
# The libraries the GPU machine lacks resolve from the pack, with no LD_LIBRARY_PATH;
# the C library does not.
resolved=$(env -u LD_LIBRARY_PATH ldd "$d/pack/bin/ferry")
for lib in libcaf_core liburing libprometheus-cpp-core libstdc++; do
  grep -Eq "${lib}[^ ]* => $d/pack/(bin/\.\./)?lib/" <<<"$resolved" || fail "$lib does not come from the pack:
$resolved"
done
if grep -q "libc\.so[^ ]* => $d/pack" <<<"$resolved"; then
  fail "the pack carries the C library"
fi
[ ! -e "$d/pack/lib/libcuda.so.1" ] || fail "the pack carries the driver library"
for lib in "$d/pack/lib/"*; do
  case "$lib" in
    */libcudart*) fail "the pack carries $lib" ;;
  esac
done

# ---- the throughput checkpoint -------------------------------------------------------
# What make_big synthesizes there, written sparse here (no disk): at least 16 GiB of
# tensor data, and the big_gib that sizes its free-space check is not below it.
# shellcheck source=../scripts/gpu-check.sh
big=$(FERRY_GPU_PACK="$d/pack" bash -c '. "$1"; echo "$big_gib|$big_synth"' sh \
  "$src/scripts/gpu-check.sh")
# shellcheck disable=SC2086  # the synth arguments are words
synth=$(env -u FERRY_GPU_PACK "$d/pack/bin/ferry" synth --from-config "$d/pack/big-config.json" \
  ${big#*|} --sparse --no-fsync --out "$d/big")
echo "$synth"
bytes=$(sed -nE 's/.*, ([0-9]+) bytes .*/\1/p' <<<"$synth")
[ "${bytes:-0}" -ge $((16 << 30)) ] || fail "the throughput checkpoint holds $bytes bytes, under 16 GiB"
[ $((${big%%|*} << 30)) -ge "$bytes" ] ||
  fail "big_gib ${big%%|*} is below the checkpoint's $bytes bytes"
rm -rf "$d/big"

# ---- the check ---------------------------------------------------------------------
status=0
OUT="$d/out" FERRY_GPU_PACK="$d/pack" bash "$src/scripts/gpu-check.sh" || status=$?
[ "$status" -eq 0 ] || fail "gpu-check.sh reported $status failed step(s)"
s="$d/out/summary.txt"
head -3 "$s" | grep -q '^commit: [0-9a-f]\{40\} ' || fail "no commit line in the header"
grep -q '^ok      the packed libraries resolve' "$s" || fail "no library step"
grep -q '^ok      host load of the packed checkpoint' "$s" || fail "no host load"
[ -s "$d/out/host-load.json" ] || fail "the host load wrote no report"
[ "$(tail -1 "$s")" = "failed steps: 0" ] || fail "the summary does not end with its count"
if ! has_gpu; then
  for line in "device: not measured (no GPU)" "driver: not measured (no GPU)" \
    "pinned H2D 64 MiB (torch), the reference: not measured (no GPU)" \
    "ferry stream onto cuda:0: not measured (no GPU)" \
    "whole process against the SGLang path: not measured (no GPU)" \
    "CUDA dump == host dump: not measured (no GPU)"; do
    head -7 "$s" | grep -qF -- "$line" || fail "the header has no '$line'"
  done
  grep -q '^skipped a GPU (nvidia-smi): no GPU' "$s" || fail "no GPU was not said"
  skipped=$(grep -c '^skipped ' "$s")
  [ "$skipped" -eq $((steps - 2)) ] || fail "$skipped steps skipped, expected every GPU step"

  # Stop early: a stand-in nvidia-smi says there is a GPU; ferry's selftest finds
  # none, fails, and every later CUDA step is skipped with the reason.
  mkdir "$d/fakebin"
  printf '%s\n' '#!/bin/sh' 'case "$*" in' '  -L) echo "GPU 0: stand-in" ;;' \
    '  *query-gpu*) echo "stand-in GPU, 1 MiB, 0.0" ;;' '  *) echo stand-in ;;' 'esac' \
    >"$d/fakebin/nvidia-smi"
  chmod +x "$d/fakebin/nvidia-smi"
  status=0
  PATH="$d/fakebin:$PATH" OUT="$d/out2" FERRY_GPU_PACK="$d/pack" \
    bash "$src/scripts/gpu-check.sh" >/dev/null || status=$?
  s2="$d/out2/summary.txt"
  cat "$s2"
  [ "$status" -eq 1 ] || fail "with a failing selftest the check reported $status failed steps, not 1"
  grep -q '^FAILED  ferry selftest --devices cuda' "$s2" || fail "the selftest did not fail"
  after=$(sed -n '/^FAILED  ferry selftest/,$p' "$s2" | sed '1d;$d')
  [ -n "$after" ] || fail "no step after the selftest"
  if grep -v '^skipped .*: ferry selftest --devices cuda failed (status 1), so no later CUDA step runs$' \
    <<<"$after"; then
    fail "a step after the failed selftest was not skipped with the reason"
  fi
  grep -q '^pinned H2D 64 MiB (torch), the reference: not measured (ferry selftest' "$s2" ||
    fail "the header does not say why pinned H2D was not measured"
fi
echo "gpu_pack_test: ok"
