#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ in build/fuzz (clang-14, ASan + UBSan),
# writes their seed corpus (fuzz/make_corpus.py) and runs them. docs/FUZZING.md
# lists the targets, what each asserts and the runs recorded.
#
#   scripts/fuzz.sh smoke [SECONDS]            every target for SECONDS (default 20), for CI;
#                                               exits non-zero on any finding
#   scripts/fuzz.sh run TARGET RUNS            one target for RUNS executions
#   scripts/fuzz.sh run TARGET --time SECONDS  one target for SECONDS
#   scripts/fuzz.sh build                      configure and build only
#
# The corpus each run grows is kept in build/fuzz/corpus/TARGET, so runs accumulate;
# seeds are regenerated into build/fuzz/seeds. Findings (crash-*, timeout-*, oom-*,
# leak-*) land in build/fuzz/findings/, logs in build/fuzz/logs/. Reproduce one with
#   build/fuzz/fuzz/TARGET build/fuzz/findings/TARGET-crash-...
# FERRY_FUZZ_JOBS sets the build's parallelism (default 2).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build/fuzz
targets=(fuzz_header fuzz_index fuzz_config fuzz_discover fuzz_plan fuzz_presharded fuzz_cache_frame fuzz_remote_control fuzz_pickle fuzz_torch_zip fuzz_gguf)

usage() {
  sed -n '6,10p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

build_targets() {
  for tool in clang-14 clang++-14 python3; do
    if ! command -v "$tool" >/dev/null; then
      echo "fuzz: $tool not found (scripts/bootstrap.sh installs clang-14 and libclang-rt-14-dev)" >&2
      exit 1
    fi
  done
  if [[ ! -f $build/CMakeCache.txt ]]; then
    CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" -G Ninja \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_FUZZ=ON -DFERRY_CUDA=OFF \
      -DFERRY_BUILD_TESTS=OFF >/dev/null
  fi
  cmake --build "$build" -j"${FERRY_FUZZ_JOBS:-2}" --target "${targets[@]}"
  python3 "$root/fuzz/make_corpus.py" "$build/seeds" >/dev/null
  mkdir -p "$build/findings" "$build/logs"
}

# run_target TARGET LOG LIBFUZZER-OPTIONS...: one libFuzzer process over the kept
# corpus and the seeds. Returns libFuzzer's status (non-zero: a finding).
run_target() {
  local target=$1 log=$2
  shift 2
  local corpus=$build/corpus/$target
  mkdir -p "$corpus"
  local extra=()
  case $target in
    # Longer inputs only slow these: a header of a few dozen tensors, a few config
    # layers, a plan's choices.
    fuzz_header) extra=(-max_len=2048) ;;
    fuzz_config | fuzz_discover | fuzz_plan) extra=(-max_len=1024) ;;
  esac
  local status=0 pid
  (cd "$build" && exec env FERRY_FUZZ_STATS=1 "$build/fuzz/$target" "$corpus" \
    "$build/seeds/$target" -artifact_prefix="$build/findings/$target-" -timeout=10 \
    -rss_limit_mb=4096 -print_final_stats=1 "${extra[@]}" "$@") >"$log" 2>&1 &
  pid=$!
  wait "$pid" || status=$?
  # fuzz_discover builds its folders in /dev/shm (else TMPDIR) and removes them at
  # exit; a process that crashed leaves its own, named by its pid.
  rm -rf /dev/shm/ferry-fuzz-discover-"$pid"-* "${TMPDIR:-/tmp}"/ferry-fuzz-discover-"$pid"-*
  local done_line
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  echo "$target: ${done_line:-no DONE line} (log: ${log#$root/})"
  grep -E '^fuzz_(plan|config):' "$log" || true
  if ((status != 0)); then
    echo "$target: FINDING (status $status); the input is in build/fuzz/findings/:" >&2
    grep -E 'FUZZ_CHECK|ERROR: |SUMMARY|runtime error|what\(\)|Test unit written' "$log" | head -20 >&2
  fi
  return $status
}

mode=${1:-}
stamp=$(date -u +%Y%m%dT%H%M%SZ)
case $mode in
  build)
    build_targets
    ;;
  smoke)
    seconds=${2:-20}
    build_targets
    failed=()
    for t in "${targets[@]}"; do
      run_target "$t" "$build/logs/$t-smoke-$stamp.log" -max_total_time="$seconds" || failed+=("$t")
    done
    if ((${#failed[@]})); then
      echo "fuzz smoke: findings in ${failed[*]}" >&2
      exit 1
    fi
    echo "fuzz smoke: ${#targets[@]} targets, ${seconds} s each, no finding"
    ;;
  run)
    target=${2:-}
    [[ " ${targets[*]} " == *" $target "* ]] || usage
    if [[ ${3:-} == --time ]]; then
      [[ ${4:-} =~ ^[0-9]+$ ]] || usage
      limit=(-max_total_time="$4")
    else
      [[ ${3:-} =~ ^[0-9]+$ ]] || usage
      limit=(-runs="$3")
    fi
    build_targets
    run_target "$target" "$build/logs/$target-run-$stamp.log" "${limit[@]}"
    ;;
  *)
    usage
    ;;
esac
