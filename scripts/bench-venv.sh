#!/usr/bin/env bash
# Creates the virtual environment the Python peers of `ferry bench` run from
# (.venv-bench, ignored by git, reused): safetensors and torch from PyPI. The only
# torch on PyPI for Linux x86-64 is the CUDA build, a download of a few GB, made
# once. `ferry bench` finds .venv-bench/bin/python in the folder it runs from, or
# the interpreter FERRY_BENCH_PYTHON names; without one the Python peers are
# skipped with a message.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-bench/bin/python ]; then
  python3 -m venv .venv-bench
fi
.venv-bench/bin/python -m pip install --upgrade pip
.venv-bench/bin/python -m pip install safetensors numpy torch
.venv-bench/bin/python -c "import torch, safetensors; print('bench venv ready: torch', torch.__version__)"
