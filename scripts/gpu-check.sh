#!/usr/bin/env bash
# The GPU check: run on the GPU machine, from the repository root, with .gpu
# carried (scripts/gpu-pack.sh makes it here). It writes everything into $OUT
# (out/gpu-check when unset): gpu-check.log, summary.txt and the load reports.
#
#   device run: carry [".gpu"], command "bash scripts/gpu-check.sh", timeout 300
#
# Without a GPU (here) it runs the parts that need none (the pack loads, its
# libraries resolve, a host load works) and skips the rest, saying so. Each step
# has its own time limit, so the whole check stays within about 4 minutes. The
# exit status is the number of failed steps (skips are not failures).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
pack=${FERRY_GPU_PACK:-$root/.gpu}
out=${OUT:-$root/out/gpu-check}
mkdir -p "$out"
log=$out/gpu-check.log
summary=$out/summary.txt
: >"$log"
: >"$summary"
export LD_LIBRARY_PATH="$pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ferry=$pack/bin/ferry
python=${FERRY_GPU_PYTHON:-python3}
shm=/dev/shm/ferry-gpu-check-medium
scratch=$(mktemp -d)
trap 'rm -rf "$scratch" "$shm"' EXIT
export root pack out log summary ferry python shm scratch
fails=0

note() { echo "$*" | tee -a "$log" >>"$summary"; }
# step NAME SECONDS CMD...: runs CMD with its output in the log, bounded in time.
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name" >>"$log"
  local started=$SECONDS
  # bash -c: the command may be one of this script's functions (exported below).
  if timeout "$limit" bash -c '"$@"' step "$@" >>"$log" 2>&1; then
    note "ok      $name ($((SECONDS - started)) s)"
  else
    note "FAILED  $name (status $?, $((SECONDS - started)) s; see gpu-check.log)"
    fails=$((fails + 1))
  fi
}
skip() { note "skipped $1: $2"; }

if [ ! -x "$ferry" ]; then
  echo "gpu-check: no $ferry: run scripts/gpu-pack.sh here and carry .gpu" >&2
  exit 1
fi
note "gpu-check of $(cat "$pack/COMMIT" 2>/dev/null || echo '?') on $(hostname), $(date -u +%FT%TZ)"

# ---- what needs no GPU -------------------------------------------------------------
libs_resolve() {
  local missing
  missing=$(ldd "$pack/bin/"* | grep "not found" || true)
  [ -z "$missing" ] || { echo "$missing"; return 1; }
}
export -f libs_resolve
step "the packed libraries resolve" 20 libs_resolve
host_load() {
  "$ferry" load --model "$pack/ck-llama" --quiet --set parallel.tp=2 \
    --report "$out/host-load.json"
}
export -f host_load
step "host load of the packed checkpoint" 60 host_load

# ---- is there a GPU ------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >>"$log" 2>&1; then
  skip "every GPU step" "nvidia-smi finds no GPU here"
  note "failed steps: $fails"
  exit "$fails"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$summary" 2>&1

step "ferry selftest --devices cuda" 60 "$ferry" selftest --devices cuda
step "CUDA tests (ferry_gpu_tests)" 90 "$pack/bin/ferry_gpu_tests" --gtest_brief=1

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$sanitizer" ]; then
  step "a small load under compute-sanitizer memcheck" 90 "$sanitizer" --tool memcheck \
    --error-exitcode 1 "$ferry" load --model "$pack/ck-llama" --quiet --set parallel.tp=1 \
    --set devices=cuda:0
else
  skip "compute-sanitizer memcheck" "no compute-sanitizer on the PATH or in /usr/local/cuda/bin"
fi

# A CUDA load's dump against a host load's, byte for byte.
same_as_host() {
  local ck=$1 name=$2
  shift 2
  local d=$scratch/dump-$name  # not under $OUT: at most 8 files come back from there
  rm -rf "$d"
  "$ferry" load --model "$ck" --quiet --set parallel.tp=1 --set "load.dump_dir=$d/host" "$@" &&
    "$ferry" load --model "$ck" --quiet --set parallel.tp=1 --set devices=cuda:0 \
      --set "load.dump_dir=$d/cuda" "$@" &&
    diff -r -q "$d/host" "$d/cuda" && rm -rf "$d"
}
export -f same_as_host
step "cuda = host: f32 casts" 60 same_as_host "$pack/ck-llama" f32 --set model.dtype=f32
step "cuda = host: f16 casts" 60 same_as_host "$pack/ck-llama" f16 --set model.dtype=f16
step "cuda = host: 4096-byte chunks" 60 same_as_host "$pack/ck-llama" chunk4k \
  --set io.chunk_bytes=4096
step "cuda = host: io.direct" 60 same_as_host "$pack/ck-llama" direct --set io.direct=true
step "cuda = host: DeepSeek (MLA split)" 60 same_as_host "$pack/ck-deepseek" deepseek
# Rank 1 of tp 2 on the one GPU: row-parallel slices narrower than 64 KiB are
# gathered on the device (actors/fragment_copy.hpp), casts go through cast_2d.
step "cuda = host: tp 2 rank 1 (gathered rows)" 60 same_as_host "$pack/ck-llama" tp2 \
  --set parallel.tp=2 --set parallel.ranks=1
step "cuda = host: tp 2 rank 1, f32 casts" 60 same_as_host "$pack/ck-llama" tp2f32 \
  --set parallel.tp=2 --set parallel.ranks=1 --set model.dtype=f32

# ---- figures -------------------------------------------------------------------------
h2d() {
  "$python" - <<'PY' | tee -a "$summary"
import torch
for mib in (1, 4, 16, 64):
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(4, (1 << 30) // n)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    print(f"pinned H2D {mib} MiB: {n * reps / (start.elapsed_time(end) / 1e3) / 1e9:.1f} GB/s")
PY
}
export -f h2d
if "$python" -c "import torch; assert torch.cuda.is_available()" >>"$log" 2>&1; then
  step "pinned H2D GB/s (torch)" 60 h2d
else
  skip "pinned H2D GB/s" "$python has no torch with CUDA"
fi

medium() {
  rm -rf "$shm"
  "$ferry" synth --family llama --preset medium --out "$shm" >/dev/null || return 1
  for i in 1 2 3; do
    "$ferry" load --model "$shm" --quiet --set parallel.tp=1 --set devices=cuda:0 \
      --report "$out/medium-$i.json" || return 1
  done
  "$python" - "$out" <<'PY' | tee -a "$summary"
import json, statistics, sys
reports = [json.load(open(f"{sys.argv[1]}/medium-{i}.json")) for i in (1, 2, 3)]
stream = [(r["read_paths"]["direct_to_device"] + r["read_paths"]["staged"]) / r["phases"]["stream"] / 1e9 for r in reports]
whole = [r["seconds"] for r in reports]
print(f"ferry medium from /dev/shm onto cuda:0: stream {statistics.median(stream):.1f} GB/s "
      f"({min(stream):.1f}-{max(stream):.1f}), load {statistics.median(whole):.2f} s")
PY
}
export -f medium
step "medium checkpoint from /dev/shm onto the GPU" 120 medium
sglang_gpu() {
  local runs=() begin end
  for i in 1 2 3; do
    begin=$(date +%s.%N)
    "$python" "$root/bench/peers/peer_sglang.py" "$shm" 1 cuda || return 1
    end=$(date +%s.%N)
    runs+=("$(awk "BEGIN { printf \"%.2f\", $end - $begin }")")
  done
  echo "SGLang path onto cuda:0 (same files), whole process: ${runs[*]} s" | tee -a "$summary"
}
export -f sglang_gpu
if [ -d "$shm" ] && "$python" -c "import safetensors, torch" >>"$log" 2>&1; then
  step "the SGLang path onto the GPU" 120 sglang_gpu
else
  skip "the SGLang path onto the GPU" "no medium checkpoint or no safetensors/torch"
fi
rm -rf "$shm"

note "failed steps: $fails"
exit "$fails"
