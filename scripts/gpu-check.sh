#!/usr/bin/env bash
# The GPU check: run on the GPU machine, from the repository root, with .gpu
# carried (scripts/gpu-pack.sh makes it here). It writes into $OUT (out/gpu-check
# when unset) summary.txt, gpu-check.log and a few reports: at most 8 files, as the
# device tool brings back.
#
#   bash scripts/gpu-check.sh --plan    # the steps, their limits and the total; runs nothing
#   device run: carry [".gpu"], command "bash scripts/gpu-check.sh", timeout_s 270
#
# The budget rule: every step has a limit (its kill grace included), and the limits
# add up to at most 240 s, so one try fits the device tool's timeout with margin.
# The steps are the one table below, in run order: what answers the most first
# (libraries, a host load, the selftest, one CUDA load against the host dump,
# pinned H2D, the throughput loads), the slow and optional ones last. A step that
# needs what an earlier one did not give is skipped, saying why: no GPU skips
# every GPU step, a failed or timed-out selftest every later CUDA step.
#
# summary.txt starts with the device, the driver, the commit and each figure
# against its target (docs/GPU.md, issue 30 section 4), "not measured (why)" where a
# step did not run; then one line a step. It is rewritten after every step, so a
# check killed from outside still leaves one. The exit status is the number of
# failed steps (skips are not failures).
#
# No LD_LIBRARY_PATH is set: the packed binaries find the packed libraries through
# their RUNPATH, and Python and torch keep the machine's own.
#
# Sourced (`. scripts/gpu-check.sh`), it defines its steps and runs nothing: how
# the step functions can be tried by hand on the host backend.
set -uo pipefail

# ---- the plan -------------------------------------------------------------------------
# One row a step, in run order: LIMIT|NEEDS|GIVES|FUNCTION|TITLE
#   LIMIT  seconds the step may take, its kill grace included
#   NEEDS  conditions an earlier step must have given (comma-separated, - for none)
#   GIVES  the condition this step gives when it passes (- for none)
readonly check_budget=240
readonly check_grace=2
readonly check_steps=(
  "5|-|-|libs_resolve|the packed libraries resolve through RUNPATH"
  "10|-|host|host_load|host load of the packed checkpoint (the reference dump)"
  "10|-|gpu|detect_gpu|a GPU (nvidia-smi)"
  "20|gpu|cuda|selftest|ferry selftest --devices cuda"
  "15|cuda,host|-|cuda_equals_host|cuda = host: the packed Llama, tp 1"
  "15|cuda,host|-|cache_serve|ferry serve on the GPU, a second process attaches (CUDA IPC)"
  "20|cuda|-|pinned_h2d|pinned H2D GB/s (torch)"
  "30|cuda|big|make_big|an 18 GiB checkpoint in page cache"
  "30|big|-|ferry_throughput|ferry: the 18 GiB checkpoint onto cuda:0"
  "35|big|-|sglang_path|the SGLang path: the same files onto cuda:0"
  "20|cuda|-|more_cases|cuda = host: casts, chunks, io.direct, DeepSeek, tp 2 rank 1"
  "10|cuda|sanitizer|sanitizer_probe|compute-sanitizer accepts the GPU"
  "10|sanitizer|-|memcheck|a small load under compute-sanitizer memcheck"
  "10|cuda|-|gpu_tests|the CUDA tests (ferry_gpu_tests)"
)

plan_total() {
  local row total=0
  for row in "${check_steps[@]}"; do
    total=$((total + ${row%%|*}))
  done
  echo "$total"
}

print_plan() {
  local row limit needs title i=0
  echo "gpu-check: the steps in run order, each limit in seconds with its ${check_grace} s kill grace"
  for row in "${check_steps[@]}"; do
    IFS='|' read -r limit needs _ _ title <<<"$row"
    i=$((i + 1))
    printf '%3d %4d s  %s%s\n' "$i" "$limit" "$title" \
      "$([ "$needs" = - ] || echo " (needs: $needs)")"
  done
  printf 'total %d s of a %d s budget; device run timeout_s %d\n' "$(plan_total)" \
    "$check_budget" "$((check_budget + 30))"
}

# ---- what the steps share ------------------------------------------------------------
# Each step runs in a bash of its own under timeout, so these are exported. A step
# skips itself with `skip_step REASON` (exit 77), and leaves figures for the
# summary with `figure KEY VALUE`.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pack=${FERRY_GPU_PACK:-$root/.gpu}
out=${OUT:-$root/out/gpu-check}
ferry=$pack/bin/ferry
python=${FERRY_GPU_PYTHON:-python3}
gpu_device=cuda:0    # where the loads go; set to host:1 when trying steps by hand
peer_device=cuda     # the SGLang path's device; cpu by hand
# The throughput checkpoint (see make_big): ferry synth's arguments besides
# --from-config "$pack/big-config.json", and its GiB of tensor data
# (tests/gpu_pack_test.sh checks that the two agree).
big_synth="--scale-dims 4096 --dtype bf16 --shard-bytes 2G"
big_gib=19  # 18.13 GiB, rounded up
export root pack out ferry python gpu_device peer_device big_synth big_gib

figure() { printf '%s\t%s\n' "$1" "$2" >>"$figures"; }
skip_step() {
  echo "$*" >"$step_why"
  exit 77
}
# Seconds left before this step's limit, less a reserve for what follows the caller
# (run_step sets step_deadline).
# shellcheck disable=SC2154
seconds_left() { echo $((step_deadline - $(date +%s) - ${1:-0})); }
# bounded RESERVE CMD...: CMD within what is left of the step, less RESERVE.
bounded() {
  local left
  left=$(seconds_left "$1")
  shift
  if [ "$left" -le 0 ]; then
    echo "no time left in this step for: $*"
    return 124
  fi
  timeout -k 1 "$left" "$@"
}
export -f figure skip_step seconds_left bounded

# ---- the steps, in the order of the plan ---------------------------------------------
libs_resolve() {
  local bin resolved
  for bin in "$pack/bin/"*; do
    resolved=$(ldd "$bin") || return 1
    echo "$resolved"
    if grep -q "not found" <<<"$resolved"; then
      echo "$bin: a library does not resolve"
      return 1
    fi
    if grep -q 'libcudart\.so' <<<"$resolved"; then
      echo "$bin loads libcudart.so; ferry links the CUDA runtime statically"
      return 1
    fi
    # Every library the pack carries comes from it, not from this machine.
    local name path
    while read -r name path; do
      if [ -e "$pack/lib/$name" ] && [ "$(readlink -f "$path")" != "$(readlink -f "$pack/lib/$name")" ]; then
        echo "$bin: $name resolves to $path, not $pack/lib (RUNPATH: $(readelf -d "$bin" | grep -i runpath | grep -o '\[.*\]' || echo none))"
        return 1
      fi
    done < <(awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' <<<"$resolved")
  done
}

host_load() {
  "$ferry" load --model "$pack/ck-llama" --quiet --set parallel.tp=1 \
    --set "load.dump_dir=$scratch/dump-llama-host" --report "$out/host-load.json"
}

detect_gpu() {
  if ! command -v nvidia-smi >/dev/null; then
    skip_step "no GPU (no nvidia-smi here)"
  fi
  if ! nvidia-smi -L; then
    skip_step "no GPU (nvidia-smi -L finds none)"
  fi
  local line
  line=$(nvidia-smi -i 0 --query-gpu=name,memory.total,driver_version --format=csv,noheader) ||
    return 1
  figure device "$(cut -d, -f1-2 <<<"$line" | sed 's/, */, /')"
  figure driver "$(cut -d, -f3 <<<"$line" | tr -d ' ')"
  nvidia-smi
}

selftest() { "$ferry" selftest --devices cuda; }

# A CUDA load's dump against a host load's, byte for byte; records the case.
same_as_host() {
  local ck=$1 name=$2
  shift 2
  local d=$scratch/dump-$name
  rm -rf "$d-host" "$d-cuda"
  "$ferry" load --model "$ck" --quiet --set parallel.tp=1 --set "load.dump_dir=$d-host" "$@" ||
    return 1
  compare_cuda_dump "$ck" "$name" "$@"
}
compare_cuda_dump() {
  local ck=$1 name=$2
  shift 2
  local d=$scratch/dump-$name
  "$ferry" load --model "$ck" --quiet --set parallel.tp=1 --set "devices=$gpu_device" \
    --set "load.dump_dir=$d-cuda" "$@" || return 1
  # Not diff: the headers' metadata names the device ("host:0" against "cuda:0").
  if python3 "$root/scripts/dumps_equal.py" "$d-host" "$d-cuda"; then
    figure dump_case "$name equal"
  else
    figure dump_case "$name DIFFERS"
    return 1
  fi
}
export -f same_as_host compare_cuda_dump

cuda_equals_host() { compare_cuda_dump "$pack/ck-llama" llama; }

# The weight cache on the GPU (issue 35): `ferry serve` holds the packed Llama on the
# GPU and shares it by CUDA IPC; a second process attaches (cache.mode daemon),
# dumps, and must equal the host load's dump.
cache_serve() {
  local reg=$scratch/cache-registry d=$scratch/dump-llama
  rm -rf "$reg" "$d-cache" "$scratch/cache-ready"
  mkdir -m 700 "$reg"
  "$ferry" serve --model "$pack/ck-llama" --set parallel.tp=1 --set "devices=$gpu_device" \
    --set "cache.dir=$reg" --ready-file "$scratch/cache-ready" >"$scratch/serve.log" 2>&1 &
  local daemon=$! i
  for i in $(seq 200); do
    [ -e "$scratch/cache-ready" ] && break
    kill -0 "$daemon" 2>/dev/null || break
    sleep 0.05
  done
  local status=0
  if [ ! -e "$scratch/cache-ready" ]; then
    cat "$scratch/serve.log"
    status=1
  elif ! "$ferry" load --model "$pack/ck-llama" --set parallel.tp=1 --set "devices=$gpu_device" \
    --set cache.mode=daemon --set "cache.dir=$reg" --set "load.dump_dir=$d-cache" \
    --report "$out/cache-client.json" --quiet; then
    status=1
  elif python3 "$root/scripts/dumps_equal.py" "$d-host" "$d-cache"; then
    figure cache_client "attached, equal to the host load"
  else
    figure cache_client "attached, DIFFERS from the host load"
    status=1
  fi
  kill -TERM "$daemon" 2>/dev/null
  wait "$daemon" 2>/dev/null
  cat "$scratch/serve.log"
  return $status
}

pinned_h2d() {
  "$python" -c "import torch; assert torch.cuda.is_available()" ||
    skip_step "$python has no torch that sees a GPU"
  "$python" - >"$scratch/h2d.txt" <<'PY' || return 1
import torch
for mib in (1, 4, 16, 64):
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(8, (1 << 30) // n)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    print(mib, f"{n * reps / (start.elapsed_time(end) / 1e3) / 1e9:.1f}")
PY
  while read -r mib gbps; do
    echo "pinned H2D $mib MiB: $gbps GB/s"
    figure "h2d_$mib" "$gbps"
  done <"$scratch/h2d.txt"
}

# The throughput checkpoint: Qwen2.5-14B's tensors (Sakura-14B's config, packed)
# scaled to hidden 4096, bf16: 579 tensors, 18.13 GiB in 10 shards of about 2 GiB.
# `ferry synth --sparse` writes it in a blink with its data regions as holes, and
# each shard is then copied with --sparse=never, in parallel: a hole in tmpfs reads
# from the one zero page, which would flatter every read. Real synth values would
# take about 1.8 s/GiB on one core; the copies about 1.2 s/GiB each, side by side.
make_big() {
  df -h /dev/shm /tmp
  local need=$(((big_gib + 1) << 30)) dir
  local shm_free tmp_free
  shm_free=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  tmp_free=$(df -B1 --output=avail /tmp 2>/dev/null | tail -1 | tr -d ' ')
  if [ "${shm_free:-0}" -ge "$need" ]; then
    dir=/dev/shm/ferry-gpu-check-big
  elif [ "${tmp_free:-0}" -ge "$need" ]; then
    echo "/dev/shm has $((${shm_free:-0} >> 30)) GiB free, under $((need >> 30)) GiB: using /tmp"
    dir=/tmp/ferry-gpu-check-big
  else
    echo "neither /dev/shm nor /tmp has $((need >> 30)) GiB free"
    return 1
  fi
  rm -rf "$dir"
  # shellcheck disable=SC2086  # big_synth is words without spaces
  "$ferry" synth --from-config "$pack/big-config.json" $big_synth --sparse --no-fsync \
    --out "$dir" || return 1
  # shellcheck disable=SC2016  # $1 is xargs's argument, expanded by that bash
  find "$dir" -name '*.safetensors' -print0 |
    xargs -0 -P 16 -n 1 bash -c 'cp --sparse=never "$1" "$1.full" && mv "$1.full" "$1"' copy ||
    return 1
  du -sh "$dir"
  echo "$dir" >"$scratch/big-dir"
  figure big_where "$(dirname "$dir")"
}

# Whole ferry processes with the default (auto) settings, as many as fit (at most
# 5): GB/s is the report's bytes_copied over its stream phase; the median is taken.
ferry_throughput() {
  local dir i begin end took longest=0
  dir=$(cat "$scratch/big-dir")
  for i in 1 2 3 4 5; do
    # Start a run only if one as long as the longest so far fits, with 3 s to spare.
    [ "$i" -eq 1 ] || [ "$(seconds_left 3)" -gt "$longest" ] || break
    begin=$(date +%s.%N)
    bounded 3 "$ferry" load --model "$dir" --quiet --set parallel.tp=1 \
      --set "devices=$gpu_device" --report "$scratch/big-$i.json" || return 1
    end=$(date +%s.%N)
    took=$(awk -v a="$begin" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
    echo "run $i: $took s"
    echo "$took" >>"$scratch/big-whole.txt"
    longest=$(awk -v a="$longest" -v b="$took" 'BEGIN { print int((a > b ? a : b) + 1) }')
  done
  "$python" - "$scratch" "$out/throughput-reports.json" <<'PY' >"$scratch/big.txt" || return 1
import glob, json, statistics, sys
scratch, keep = sys.argv[1], sys.argv[2]
reports = [json.load(open(f)) for f in sorted(glob.glob(f"{scratch}/big-*.json"))]
json.dump(reports, open(keep, "w"), indent=1)
whole = [float(x) for x in open(f"{scratch}/big-whole.txt").read().split()]
stream = [r["bytes_copied"] / r["phases"]["stream"] / 1e9 for r in reports]
print("ferry_gbps", f"{statistics.median(stream):.1f}")
print("ferry_gbps_runs", " ".join(f"{x:.1f}" for x in stream))
print("ferry_gib", f"{reports[0]['bytes_copied'] / 2**30:.2f}")
print("ferry_whole_s", f"{statistics.median(whole):.2f}")
print("ferry_whole_runs", " ".join(f"{x:.2f}" for x in whole))
PY
  cat "$scratch/big.txt"
  while read -r key value; do
    figure "$key" "$value"
  done <"$scratch/big.txt"
}

# bench/peers/peer_sglang.py on the same files, whole processes, as many as fit (at
# most 3), median. A first run stopped at the step's limit still answers the
# question as a lower bound.
sglang_path() {
  "$python" -c "import safetensors, torch" || skip_step "$python has no safetensors or torch"
  local dir i begin end took longest=0 runs=() status
  dir=$(cat "$scratch/big-dir")
  for i in 1 2 3; do
    [ "$i" -eq 1 ] || [ "$(seconds_left 2)" -gt "$longest" ] || break
    begin=$(date +%s.%N)
    status=0
    bounded 2 "$python" "$root/bench/peers/peer_sglang.py" "$dir" 1 "$peer_device" || status=$?
    end=$(date +%s.%N)
    if [ "$status" -ne 0 ]; then
      if [ "$i" -eq 1 ] && { [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; }; then
        took=$(awk -v a="$begin" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
        echo "run 1 stopped after $took s, at the step's limit"
        figure sglang_more_than_s "$took"
        return 0
      fi
      return 1
    fi
    took=$(awk -v a="$begin" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
    echo "run $i: $took s"
    runs+=("$took")
    longest=$(awk -v a="$longest" -v b="$took" 'BEGIN { print int((a > b ? a : b) + 1) }')
  done
  figure sglang_whole_s "$(printf '%s\n' "${runs[@]}" | sort -n |
    awk '{ v[NR] = $1 } END { printf "%.2f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
  figure sglang_whole_runs "${runs[*]}"
}

# Rank 1 of tp 2 on the one GPU: row-parallel slices narrower than 64 KiB are
# gathered on the device (actors/fragment_copy.hpp), casts go through cast_2d.
more_cases() {
  local failed=0
  same_as_host "$pack/ck-llama" tp2 --set parallel.tp=2 --set parallel.ranks=1 || failed=1
  same_as_host "$pack/ck-deepseek" deepseek || failed=1
  same_as_host "$pack/ck-llama" f32 --set model.dtype=f32 || failed=1
  same_as_host "$pack/ck-llama" tp2f32 --set parallel.tp=2 --set parallel.ranks=1 \
    --set model.dtype=f32 || failed=1
  same_as_host "$pack/ck-llama" f16 --set model.dtype=f16 || failed=1
  same_as_host "$pack/ck-llama" chunk4k --set io.chunk_bytes=4096 || failed=1
  same_as_host "$pack/ck-llama" direct --set io.direct=true || failed=1
  return "$failed"
}

sanitizer_path() {
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null
}
# Some machines' compute-sanitizer refuses the device ("Device not supported", then
# error 999 at the first allocation): a dummy load (no reads, one fill kernel a
# parameter) shows it in seconds, and refusal skips memcheck.
sanitizer_probe() {
  local sanitizer status=0
  sanitizer=$(sanitizer_path) || skip_step "no compute-sanitizer on the PATH or in /usr/local/cuda/bin"
  "$sanitizer" --tool memcheck --error-exitcode 1 "$ferry" load --model "$pack/ck-llama" --quiet \
    --set parallel.tp=1 --set "devices=$gpu_device" --set model.load_format=dummy \
    >"$scratch/probe.txt" 2>&1 || status=$?
  cat "$scratch/probe.txt"
  if grep -qi "not supported" "$scratch/probe.txt"; then
    skip_step "compute-sanitizer refused the GPU: $(grep -i -m1 "not supported" "$scratch/probe.txt")"
  fi
  [ "$status" -eq 0 ] || skip_step "compute-sanitizer's probe ended with status $status (see the log)"
}

memcheck() {
  "$(sanitizer_path)" --tool memcheck --error-exitcode 1 "$ferry" load --model "$pack/ck-llama" \
    --quiet --set parallel.tp=2 --set parallel.ranks=1 --set model.dtype=f32 \
    --set "devices=$gpu_device"
}

gpu_tests() { "$pack/bin/ferry_gpu_tests" --gtest_brief=1; }

export -f libs_resolve host_load detect_gpu selftest cuda_equals_host cache_serve pinned_h2d \
  make_big ferry_throughput sglang_path more_cases sanitizer_path sanitizer_probe memcheck gpu_tests

# ---- the summary ---------------------------------------------------------------------
figure_of() { awk -F'\t' -v k="$1" '$1 == k { v = $2 } END { printf "%s", v }' "$figures"; }
# Why a figure is missing: the outcome of the step that makes it.
not_measured() {
  if [ -z "${gave[gpu]:-}" ] && [ -n "${outcome[detect_gpu]:-}" ]; then
    echo "not measured (no GPU)"
  elif [ -n "${outcome[$1]:-}" ] && [ "${outcome[$1]}" != ok ]; then
    echo "not measured (${outcome[$1]})"
  else
    echo "not measured (not run yet)"
  fi
}
met() { awk "BEGIN { exit !($1) }" && echo "met" || echo "NOT met"; }

write_summary() {
  local device driver h2d gbps whole sglang cases equal total
  device=$(figure_of device)
  driver=$(figure_of driver)
  h2d=$(figure_of h2d_64)
  gbps=$(figure_of ferry_gbps)
  whole=$(figure_of ferry_whole_s)
  sglang=$(figure_of sglang_whole_s)
  {
    echo "device: ${device:-$(not_measured detect_gpu)}"
    echo "driver: ${driver:-$(not_measured detect_gpu)}"
    echo "commit: $(cat "$pack/COMMIT" 2>/dev/null || echo '?') (the pack's), checked on ${HOSTNAME:-?} at $started_at"
    if [ -n "$h2d" ]; then
      echo "pinned H2D 64 MiB (torch), the reference: $h2d GB/s" \
        "(1, 4, 16 MiB: $(figure_of h2d_1), $(figure_of h2d_4), $(figure_of h2d_16) GB/s)"
    else
      echo "pinned H2D 64 MiB (torch), the reference: $(not_measured pinned_h2d)"
    fi
    if [ -n "$gbps" ]; then
      local pct="?" verdict
      if [ -n "$h2d" ]; then
        pct=$(awk -v a="$gbps" -v b="$h2d" 'BEGIN { printf "%.0f", 100 * a / b }')
        verdict=$(met "$gbps >= 40 && $gbps >= 0.9 * $h2d")
      else
        verdict="$(met "$gbps >= 40") for 40 GB/s, no reference for 90 %"
      fi
      echo "ferry stream, $(figure_of ferry_gib) GiB from $(figure_of big_where) onto cuda:0:" \
        "$gbps GB/s (the median of $(figure_of ferry_gbps_runs)) = $pct % of the reference;" \
        "target >= 90 % and >= 40 GB/s: $verdict"
    else
      echo "ferry stream onto cuda:0: $(not_measured ferry_throughput); target >= 90 % of the reference and >= 40 GB/s"
    fi
    local sglang_more
    sglang_more=$(figure_of sglang_more_than_s)
    if [ -n "$whole" ] && [ -n "$sglang_more" ]; then
      echo "whole process, ferry $whole s vs the SGLang path over $sglang_more s (stopped" \
        "at its limit; same files): over $(awk -v a="$sglang_more" -v b="$whole" 'BEGIN { printf "%.1f", a / b }')x;" \
        "target >= 3x: $(met "$sglang_more >= 3 * $whole")"
    elif [ -n "$whole" ] && [ -n "$sglang" ]; then
      echo "whole process, ferry $whole s vs the SGLang path $sglang s (same files):" \
        "$(awk -v a="$sglang" -v b="$whole" 'BEGIN { printf "%.1f", a / b }')x;" \
        "target >= 3x: $(met "$sglang >= 3 * $whole")"
    else
      local why=ferry_throughput
      [ -z "$whole" ] || why=sglang_path
      echo "whole process against the SGLang path: $(not_measured $why); target >= 3x"
    fi
    cases=$(awk -F'\t' '$1 == "dump_case"' "$figures" | wc -l)
    equal=$(awk -F'\t' '$1 == "dump_case" && $2 ~ / equal$/' "$figures" | wc -l)
    if [ "$cases" -gt 0 ]; then
      echo "CUDA dump == host dump: $equal of $cases case(s) equal; target all:" \
        "$(met "$equal == $cases")$(awk -F'\t' '$1 == "dump_case" && $2 ~ /DIFFERS$/ { printf " (%s)", $2 }' "$figures")"
    else
      echo "CUDA dump == host dump: $(not_measured cuda_equals_host); target all"
    fi
    local cache
    cache=$(figure_of cache_client)
    echo "weight cache over CUDA IPC: ${cache:-$(not_measured cache_serve)}; target: attached, equal"
    echo
    cat "$steps_done"
    echo "failed steps: $fails"
  } >"$summary"
}

# ---- running the plan ------------------------------------------------------------------
run_step() {
  local limit=$1 fn=$2 title=$3 begin status took
  echo "== $title (limit $limit s)" >>"$log"
  begin=$SECONDS
  : >"$step_why"
  # -k: a step that ignores TERM (a CUDA call stuck in the driver) is killed; the
  # whole step, grace included, ends within its limit.
  # The braces take bash's own "Killed" notice into the log too.
  {
    step_deadline=$(($(date +%s) + limit - check_grace)) \
      timeout -k "$check_grace" "$((limit - check_grace))" bash -c "$fn"
  } >>"$log" 2>&1
  status=$?
  took=$((SECONDS - begin))
  if [ "$status" -eq 0 ]; then
    outcome[$fn]=ok
    echo "ok      $title ($took s)" >>"$steps_done"
    return 0
  fi
  if [ "$status" -eq 77 ]; then
    outcome[$fn]=$(cat "$step_why")
    echo "skipped $title: ${outcome[$fn]}" >>"$steps_done"
  elif [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    outcome[$fn]="$title timed out after $took s"
    echo "FAILED  $title: timed out (limit $limit s)" >>"$steps_done"
    fails=$((fails + 1))
  else
    outcome[$fn]="$title failed (status $status)"
    echo "FAILED  $title (status $status, $took s; see gpu-check.log)" >>"$steps_done"
    fails=$((fails + 1))
  fi
  return 1
}

run_plan() {
  local row limit needs gives fn title need missing
  for row in "${check_steps[@]}"; do
    IFS='|' read -r limit needs gives fn title <<<"$row"
    missing=
    if [ "$needs" != - ]; then
      for need in ${needs//,/ }; do
        if [ -z "${gave[$need]:-}" ]; then
          missing=${why_not[$need]:-no earlier step gave $need}
          break
        fi
      done
    fi
    if [ -n "$missing" ]; then
      outcome[$fn]=$missing
      [ "$gives" = - ] || why_not[$gives]=$missing
      echo "skipped $title: $missing" >>"$steps_done"
      echo "== $title: skipped, $missing" >>"$log"
    elif run_step "$limit" "$fn" "$title"; then
      [ "$gives" = - ] || gave[$gives]=1
    elif [ "$gives" != - ]; then
      why_not[$gives]=${outcome[$fn]}
      # Say once what stopping early means.
      [ "$gives" != cuda ] || why_not[cuda]+=", so no later CUDA step runs"
    fi
    write_summary
  done
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  return 0  # sourced: the steps are defined, nothing runs
fi

case "${1:-}" in
  --plan)
    print_plan
    [ "$(plan_total)" -le "$check_budget" ]
    exit
    ;;
  "") ;;
  *)
    echo "usage: bash scripts/gpu-check.sh [--plan]" >&2
    exit 2
    ;;
esac
# ferry warns about FERRY_ variables it does not know; these were the script's.
unset FERRY_GPU_PACK FERRY_GPU_PYTHON
if [ "$(plan_total)" -gt "$check_budget" ]; then
  echo "gpu-check: the limits add up to $(plan_total) s, over the $check_budget s budget" >&2
  exit 1
fi
if [ ! -x "$ferry" ]; then
  echo "gpu-check: no $ferry: run scripts/gpu-pack.sh here and carry .gpu" >&2
  exit 1
fi

mkdir -p "$out"
log=$out/gpu-check.log
summary=$out/summary.txt
scratch=$(mktemp -d)  # not under $OUT: at most 8 files come back from there
trap 'rm -rf "$scratch" /dev/shm/ferry-gpu-check-big /tmp/ferry-gpu-check-big' EXIT
figures=$scratch/figures
steps_done=$scratch/steps
step_why=$scratch/why
export log scratch figures step_why
: >"$log"
: >"$figures"
: >"$steps_done"
started_at=$(date -u +%FT%TZ)
declare -A gave=() why_not=() outcome=()
fails=0
print_plan >>"$log"
run_plan
write_summary
cat "$summary"
exit "$fails"
