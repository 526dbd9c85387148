#!/usr/bin/env bash
# `pip install .` in a virtual environment (issue 16 §2), then the module's tests
# run against the installed package instead of the build tree:
#   pip_install_test.sh BUILD_DIR SOURCE_DIR PYTHON FERRY_CLI
# The venv lives in BUILD_DIR/python-venv (with the system's site packages, for
# numpy); scikit-build-core comes from PyPI (exit 77, skipped, when it cannot be
# had). The wheel's CMake tree is BUILD_DIR/pip-build, kept between runs, and
# ccache keys on paths relative to the checkout, so the compiles of BUILD_DIR's
# own tree are reused: CAF's code is not compiled again.
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
"$venv/bin/python" -m pip install -q --no-build-isolation -C build-dir="$build/pip-build" "$src" ||
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
