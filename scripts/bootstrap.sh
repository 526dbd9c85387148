#!/usr/bin/env bash
# Installs what ferry needs to build and test, from Debian's packages (and two
# Python packages used only by interoperability tests). Idempotent: when all is
# present it only checks, in well under a second.
set -euo pipefail

packages=(g++ cmake ninja-build pkg-config ccache
          libcaf-dev liburing-dev nlohmann-json3-dev prometheus-cpp-dev libcli11-dev libdlpack-dev
          libgtest-dev libgmock-dev libbenchmark-dev pybind11-dev
          libxxhash-dev  # XXH3-128 checksums (common/xxh3.hpp)
          libucx-dev ucx-utils  # remote_instance's transport (remote/), ucx_perftest
          iproute2  # ip netns: the remote_instance tests' two hosts
          clang-14 libclang-rt-14-dev  # libFuzzer (scripts/fuzz.sh)
          patchelf)  # the GPU pack's RUNPATH (scripts/gpu-pack.sh)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "bootstrap: missing Debian packages: ${missing[*]}" >&2
    echo "bootstrap: run as root, or: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "bootstrap: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Interoperability tests compare with the official safetensors library and llama.cpp's
# gguf-py. They skip with a message when one is missing, so a failure here is not
# fatal.
py=$(command -v python3 || true)
if [[ -n "$py" ]] && ! "$py" -c 'import safetensors, numpy, gguf' 2>/dev/null; then
  echo "bootstrap: installing the Python packages safetensors, numpy and gguf (interop tests)"
  "$py" -m pip install -q safetensors numpy gguf 2>/dev/null ||
    "$py" -m pip install -q --break-system-packages safetensors numpy gguf 2>/dev/null ||
    echo "bootstrap: could not install safetensors/numpy/gguf for Python; interop tests will skip" >&2
fi
exit 0
