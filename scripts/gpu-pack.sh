#!/usr/bin/env bash
# Packs what the GPU check needs into .gpu/ (ignored by git, carried to the GPU
# machine by the device tool): a Release build with the CUDA backend for sm_90
# (H100/H200), the CUDA test binary, every shared library they need that the GPU
# machine's image lacks, and a small synthetic checkpoint. Run it here:
#
#   bash scripts/gpu-pack.sh            # then: device run, carry [".gpu"],
#                                       #   command "bash scripts/gpu-check.sh"
#
# The GPU machine cannot install ferry's Debian libraries (CAF, liburing,
# prometheus-cpp, gtest, ...), so they travel in .gpu/lib; its C library is newer
# than Debian bookworm's, so glibc itself stays behind. The packed binaries find
# them through a RUNPATH of $ORIGIN/../lib (the libraries through $ORIGIN), set
# here with patchelf, so the check needs no LD_LIBRARY_PATH and Python and torch on
# that machine keep loading their own libstdc++ and libcudart. ferry links the CUDA
# runtime statically (CUDA::cudart_static), so no libcudart.so is packed or loaded;
# the pack fails if one is. The pack must stay under the device tool's 64 MiB: the
# script fails when it does not.
#
# FERRY_GPU_BUILD=DIR packs from an existing build with the CUDA backend instead
# of configuring build/gpu, and FERRY_GPU_PACK=DIR writes the pack elsewhere: how
# the test suite (gpu.pack_and_check_without_gpu) checks the pack on every CUDA
# build without compiling ferry twice.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FERRY_GPU_BUILD:-build/gpu}
pack=${FERRY_GPU_PACK:-.gpu}
limit=$((60 << 20))  # bytes: the carried paths and the tree travel within 64 MiB

if ! command -v patchelf >/dev/null; then
  echo "gpu-pack: no patchelf (the Debian package patchelf; scripts/bootstrap.sh installs it)" >&2
  exit 1
fi
if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  echo "gpu-pack: no CUDA toolkit (nvcc) here; the pack needs the CUDA backend" >&2
  exit 1
fi
if [ -z "${FERRY_GPU_BUILD:-}" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
  cmake --build "$build" -j "$(nproc)" --target ferry ferry_gpu_tests
elif ! grep -qa cudaGetDeviceCount "$build/ferry" 2>/dev/null; then
  echo "gpu-pack: $build has no CUDA backend" >&2
  exit 1
fi
for bin in "$build/ferry" "$build/tests/ferry_gpu_tests"; do
  [ -x "$bin" ] || { echo "gpu-pack: $bin is not built" >&2; exit 1; }
done

rm -rf "$pack"
mkdir -p "$pack/bin" "$pack/lib"
cp "$build/ferry" "$build/tests/ferry_gpu_tests" "$pack/bin/"
strip --strip-unneeded "$pack/bin/"*

# The CUDA runtime is linked in (CMAKE_CUDA_RUNTIME_LIBRARY Static): a libcudart.so
# here would be loaded next to torch's on the GPU machine, the clash the static
# runtime avoids.
for bin in "$pack/bin/"*; do
  # Matched on the whole output: with pipefail, grep -q quitting first would kill ldd
  # with SIGPIPE and make the match read as no match.
  libs=$(env -u LD_LIBRARY_PATH ldd "$bin")
  if grep -q 'libcudart\.so' <<<"$libs"; then
    echo "gpu-pack: $bin loads libcudart.so; the CUDA runtime must be linked statically" >&2
    exit 1
  fi
done

# Every library the binaries load, except the C library's own (the GPU machine's
# is newer) and the driver (that machine's must be used).
keep_out='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libcuda\.so)'
for bin in "$pack/bin/"*; do
  env -u LD_LIBRARY_PATH ldd "$bin" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ ! "$name" =~ $keep_out ]]; then
    cp -L "$path" "$pack/lib/$name"
  fi
done

# RUNPATH, not LD_LIBRARY_PATH: the binaries look in ../lib first, the libraries
# beside themselves (a RUNPATH serves only its own object's dependencies, so a
# library that needs another packed one, civetweb needing zlib, must carry its own).
# The machine's Python and torch never see these.
# shellcheck disable=SC2016  # $ORIGIN is the loader's, not the shell's
patchelf --set-rpath '$ORIGIN/../lib' "$pack/bin/"*
for lib in "$pack/lib/"*; do
  chmod u+w "$lib"
  # shellcheck disable=SC2016
  patchelf --set-rpath '$ORIGIN' "$lib"
done
for bin in "$pack/bin/"*; do
  resolved=$(env -u LD_LIBRARY_PATH ldd "$bin")
  if grep -q "not found" <<<"$resolved"; then
    echo "gpu-pack: $bin does not resolve from the pack:" >&2
    echo "$resolved" >&2
    exit 1
  fi
done

# A small checkpoint for the quick checks; the check synthesizes the medium one
# there, into /dev/shm, with the packed ferry.
"$pack/bin/ferry" synth --family llama --preset tiny --out "$pack/ck-llama" >/dev/null
"$pack/bin/ferry" synth --family deepseek_v3 --preset tiny --out "$pack/ck-deepseek" >/dev/null

# The throughput checkpoint's model, Qwen2.5-14B's shapes (Sakura-14B's config):
# gpu-check.sh synthesizes it there, scaled to about 18 GiB. The shared data does
# not travel; this file does.
big_config=../shared/data/models/sakura-14b-qwen2.5/config.json
if [ ! -f "$big_config" ]; then
  echo "gpu-pack: no $big_config (the shared data, beside the repository)" >&2
  exit 1
fi
cp "$big_config" "$pack/big-config.json"

git rev-parse HEAD > "$pack/COMMIT" 2>/dev/null || echo unknown > "$pack/COMMIT"
bytes=$(du -sb "$pack" | cut -f1)
echo "gpu-pack: $pack is $((bytes >> 20)) MiB ($(ls "$pack/lib" | wc -l) libraries) at $(cat "$pack/COMMIT")"
if [ "$bytes" -gt "$limit" ]; then
  echo "gpu-pack: $pack is over $((limit >> 20)) MiB; the device tool carries 64 MiB with the tree" >&2
  exit 1
fi
