#!/usr/bin/env bash
# The README's first command: build ferry (Release) and run its main job on the
# embedded default configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/release --target ferry
exec build/release/ferry demo "$@"
