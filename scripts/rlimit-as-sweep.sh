#!/usr/bin/env bash
# Sweeps `ferry load` under RLIMIT_AS (ulimit -v) and counts how each run ended:
# loaded, one clean error, a signal (an abort or a crash), or a hang (killed after
# 60 s); the last two must not happen.
# The figures in docs/OPERATING.md ("Address-space limits") come from it.
#
#   scripts/rlimit-as-sweep.sh FERRY LO_KIB HI_KIB STEP_KIB REPEATS [ENV=VALUE...]
#
# e.g. scripts/rlimit-as-sweep.sh build/release/ferry 16384 337920 256 4
#      scripts/rlimit-as-sweep.sh build/release/ferry 16384 337920 256 4 MALLOC_ARENA_MAX=8
# Extra ENV=VALUE words are set for each run (MALLOC_ARENA_MAX=8 undoes the CLI's
# one arena, for the comparison). Runs a tiny synthetic llama at --tp 2 with two
# read lanes, like AttackThreads.RealAddressSpaceLimit.
set -euo pipefail
ferry=$(realpath "$1"); lo=$2; hi=$3; step=$4; repeats=$5; shift 5
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$ferry" synth --family llama --preset tiny --out "$work/ck" > /dev/null
loaded=0; errors=0; signals=0; hangs=0; runs=0
for ((r = 0; r < repeats; ++r)); do
  for ((kib = lo; kib <= hi; kib += step)); do
    rc=0
    (ulimit -c 0; ulimit -v "$kib"; exec env "$@" timeout -s KILL 60 "$ferry" load --model "$work/ck" --tp 2 --quiet \
       --set io.read_lanes=2) > /dev/null 2> "$work/err" || rc=$?
    runs=$((runs + 1))
    if ((rc == 0)); then
      loaded=$((loaded + 1))
    elif ((rc == 137)); then
      hangs=$((hangs + 1))
      echo "hang at ${kib} KiB"
    elif ((rc > 128)); then
      signals=$((signals + 1))
      echo "signal $((rc - 128)) at ${kib} KiB: $(head -c 160 "$work/err" | tr '\n' ' ')"
    else
      errors=$((errors + 1))
    fi
  done
done
echo "runs $runs: loaded $loaded, clean errors $errors, signals $signals, hangs $hangs"
