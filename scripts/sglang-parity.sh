#!/usr/bin/env bash
# Runs the SGLang parity matrix (tests/parity/): for each case, SGLang 0.5.23's
# own loader on the CPU against `ferry load --dump-dir`, rank by rank. Outside
# CI: the venv holds torch and SGLang, several GB.
#
#   scripts/sglang-parity.sh --setup            create/refresh the venv
#   scripts/sglang-parity.sh [OPTIONS]          run the matrix (see --help)
#   scripts/sglang-parity.sh --only llama --jobs 2 --update-docs
#
# The interpreter is FERRY_PARITY_PYTHON, else .venv-bench/bin/python (the venv
# scripts/bench-venv.sh makes; --setup adds SGLang to it). The ferry binary is
# build/release/ferry (cmake --build build/release --target ferry), or --ferry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${FERRY_PARITY_PYTHON:-.venv-bench/bin/python}"

# All parity work pins this SGLang release from PyPI (docs/ARCHITECTURE.md).
SGLANG_VERSION=0.5.23

if [ "${1:-}" = "--setup" ]; then
  if [ ! -x "$PY" ]; then
    python3 -m venv "$(dirname "$(dirname "$PY")")"
  fi
  "$PY" -m pip install --upgrade pip
  "$PY" -m pip install torch==2.14.1 safetensors numpy transformers==5.19.0 \
    compressed-tensors==0.18.0 einops
  # SGLang without its dependencies (flashinfer, sgl-kernel, ... need a GPU);
  # then the few packages its model, layer and loader modules import at module
  # level, found by importing them; the versions the harness was run with (SGLang
  # pins apache-tvm-ffi and openai itself).
  "$PY" -m pip install "sglang==$SGLANG_VERSION" --no-deps
  "$PY" -m pip install orjson==3.13.0 pybase64==1.5.1 requests==2.34.2 \
    pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0 pyzmq==27.3.0 \
    ipython==9.18.1 aiohttp==3.14.5 apache-tvm-ffi==0.1.11 torchvision==0.29.2 \
    dill==0.4.1 sentencepiece==0.2.3 gguf==0.19.0 openai==2.8.0 \
    partial-json-parser==0.2.1.1.post7 xxhash==3.6.0
  # FlashInfer as SGLang 0.5.23 pins it, for flashinfer_trtllm's weight preparation
  # on sm100 (its row permutations are torch; tests/parity/README.md, item 13).
  "$PY" -m pip install flashinfer-python==0.7.2 --no-deps
  "$PY" -m pip install nvidia-ml-py==13.615.71
  "$PY" -W ignore -c "import sglang, sglang.srt.models.deepseek_v2, sglang.srt.models.llama; print('parity venv ready: sglang', sglang.__version__)"
  exit 0
fi

if [ ! -x "$PY" ]; then
  echo "no interpreter at $PY: run scripts/sglang-parity.sh --setup or set FERRY_PARITY_PYTHON" >&2
  exit 2
fi
# NVFP4's postprocess.target layouts replayed in numpy without SGLang
# (tests/parity/nvfp4_targets.py), on the same ferry binary; then the matrix. Not
# for --help or --list.
FERRY=build/release/ferry
replay=1
prev=
for arg in "$@"; do
  case "$arg" in
    --help | -h | --list) replay=0 ;;
    --ferry=*) FERRY="${arg#--ferry=}" ;;
  esac
  [ "$prev" = "--ferry" ] && FERRY="$arg"
  prev="$arg"
done
if [ "$replay" = 1 ]; then
  case "$PY" in /*) py="$PY" ;; *) py="$PWD/$PY" ;; esac
  case "$FERRY" in /*) ferry="$FERRY" ;; *) ferry="$PWD/$FERRY" ;; esac
  (cd tests/parity && "$py" nvfp4_targets.py --ferry "$ferry")
fi
exec "$PY" tests/parity/run_parity.py "$@"
