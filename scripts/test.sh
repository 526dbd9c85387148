#!/usr/bin/env bash
# The README's second command (and CI's): build every target and run every test
#   - in Debug with AddressSanitizer and UndefinedBehaviorSanitizer (build/asan),
#   - in Release (build/release), the CUDA backend too where the toolkit exists
#     (the sanitizer builds leave it out),
#   - the layers without CAF (common, io, gpu, models) once more with
#     ThreadSanitizer (build/tsan): Debian's CAF is not instrumented, which
#     ThreadSanitizer needs,
# warnings as errors throughout; then a short smoke run of every fuzz target
# (scripts/fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
jobs=$(nproc)
# ccache keys on paths relative to the checkout, so a fresh clone in another
# folder (CI's) reuses what an earlier build on this machine compiled.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-true}
# What a sanitizer finds fails the test that ran into it (a leak too, at exit).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/scripts/lsan.supp:print_suppressions=0}

# Each phase's wall time goes to the log and, at the end, to one summary line (the
# CI time budget: the README, "Quick start").
start=$SECONDS phase_start=$SECONDS phases=()
phase() {  # phase NAME: ends the running phase, starts NAME
  local now=$SECONDS
  [ ${#phases[@]} -gt 0 ] && phases[-1]+=" $((now - phase_start))s"
  phase_start=$now
  [ $# -gt 0 ] && phases+=("$1") && echo "== $1 (at $((now - start))s)"
  return 0
}

build() {  # build DIR TARGETS... -- CMAKE_ARGS...
  local dir=$1 targets=() args=()
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do targets+=(--target "$1"); shift; done
  [ $# -gt 0 ] && shift
  args=("$@")
  phase "build $dir"
  echo "   ${args[*]}"
  cmake -S . -B "$dir" -G Ninja "${args[@]}" >/dev/null
  cmake --build "$dir" -j "$jobs" "${targets[@]}"
}
# The CUDA backend is built (and its tests run where a GPU is) in Release only:
# no GPU runs under the sanitizers here, and nvcc's time is better spent once.
build build/asan -- -DCMAKE_BUILD_TYPE=Debug -DFERRY_SANITIZE=address,undefined -DFERRY_CUDA=OFF \
  -DFERRY_WERROR=ON
build build/release -- -DCMAKE_BUILD_TYPE=Release -DFERRY_WERROR=ON
build build/tsan ferry_common_tests ferry_io_tests ferry_cache_tests ferry_gpu_tests ferry_models_tests \
  -- -DCMAKE_BUILD_TYPE=Debug -DFERRY_SANITIZE=thread -DFERRY_CUDA=OFF -DFERRY_WERROR=ON
# Under ThreadSanitizer, not the placement contracts: element-by-element checks of
# what each rank holds against the independent references, single-threaded math
# over plain data (models/ has no threads), which ASan and Release run in full.
# They took 1,640 of the 2,050 test seconds there (CI, 2026-12-05).
tsan_skip='^[^ ]*(QuantContract|DeepseekFp8Reference|MoeContract|DeepseekReference|DenseReference)\.'
for dir in build/asan build/release build/tsan; do
  phase "tests in $dir"
  skip=()
  [ "$dir" = build/tsan ] && skip=(-E "$tsan_skip")
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" "${skip[@]}"
done
phase "fuzz smoke"
bash scripts/fuzz.sh smoke "${FERRY_FUZZ_SMOKE_SECONDS:-20}"
phase
echo "== done in $((SECONDS - start))s:$(printf ' %s;' "${phases[@]}")"
