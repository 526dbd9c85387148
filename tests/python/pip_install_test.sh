#!/usr/bin/env bash
# `pip install .` in a virtual environment (issue 16 §2), then the module's tests
# run against the installed package instead of the build tree:
#   pip_install_test.sh BUILD_DIR SOURCE_DIR PYTHON FERRY_CLI
# The venv lives in BUILD_DIR/python-venv (with the system's site packages, for
# numpy); scikit-build-core comes from PyPI (exit 77, skipped, when it cannot be
# had). The wheel's CMake tree is BUILD_DIR-pip beside BUILD_DIR (build/release-pip),
# kept between runs: at the same depth as BUILD_DIR, its compile commands are
# BUILD_DIR's once ccache makes their paths relative, so BUILD_DIR's compiles are
# taken from the cache and CAF's code is not compiled again.
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
python=$3
cli=$(realpath "$4")
venv=$build/python-venv
export CCACHE_BASEDIR=$src CCACHE_NOHASHDIR=true
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv --system-site-packages "$venv"
fi
if ! "$venv/bin/python" -c 'import scikit_build_core' 2>/dev/null; then
  if ! "$venv/bin/python" -m pip install -q 'scikit-build-core>=0.10' 2>"$build/pip-skbuild.log"; then
    echo "pip_install_test: scikit-build-core could not be installed (see $build/pip-skbuild.log); skipped"
    exit 77
  fi
fi
"$venv/bin/python" -m pip uninstall -q -y ferry 2>/dev/null || true
echo "== pip install $src"
# The same compiler as BUILD_DIR's (ccache keys on its name too; left alone,
# the backend takes Python's own, g++ where BUILD_DIR has c++).
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
"$venv/bin/python" -m pip install -q --no-build-isolation -C build-dir="$build-pip" \
  -C cmake.define.CMAKE_CXX_COMPILER="$cxx" "$src" ||
  { echo "pip_install_test: FAIL: pip install" >&2; exit 1; }
where=$(cd / && "$venv/bin/python" -c 'import ferry, os; print(os.path.dirname(ferry.__file__))')
case $where in
  "$venv"/*) ;;
  *) echo "pip_install_test: FAIL: ferry imported from $where, not the venv" >&2; exit 1 ;;
esac
[ -e "$where/_ferry"*.so ] 2>/dev/null || ls "$where"/_ferry*.so >/dev/null ||
  { echo "pip_install_test: FAIL: no module in $where" >&2; exit 1; }
ls "$where"/libferry.so* >/dev/null || { echo "pip_install_test: FAIL: no libferry.so in $where" >&2; exit 1; }
echo "== the module's tests against $where"
cd / && env -u PYTHONPATH "$venv/bin/python" "$src/tests/python/test_ferry.py" "$cli"
