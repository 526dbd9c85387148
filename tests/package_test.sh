#!/usr/bin/env bash
# The installed C++ package (issue 16 §1), as an engine's build meets it:
#   package_test.sh BUILD_DIR SOURCE_DIR
# installs BUILD_DIR into a temporary prefix, then checks that
#   - libferry.so, include/ferry/, ferryConfig.cmake, ferry.pc and bin/ferry are there;
#   - libferry.so exports namespace ferry only (no CAF, nlohmann, prometheus, liburing,
#     std) and keeps its libraries as dependencies;
#   - every installed header compiles alone with only the prefix on the include path,
#     and none pulls in a header of ferry's tree or of CAF, liburing or nlohmann
#     (prometheus-cpp only through ferry/metrics.hpp);
#   - a program built with `pkg-config ferry` links and runs;
#   - examples/engine_boot, as a stand-alone project with find_package(ferry), and a
#     ferry::metrics consumer build against the prefix and pass on a synthesized
#     checkpoint.
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cxx=${CXX:-c++}

fail() { echo "package_test: FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }

step "cmake --install"
cmake --install "$build" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log"; fail "install"; }
libdir=$prefix/lib
[ -d "$libdir" ] || libdir=$(dirname "$(find "$prefix" -name 'libferry.so' | head -1)")
for f in "$libdir/libferry.so" "$libdir/cmake/ferry/ferryConfig.cmake" \
         "$libdir/cmake/ferry/ferryConfigVersion.cmake" "$libdir/cmake/ferry/ferryTargets.cmake" \
         "$libdir/pkgconfig/ferry.pc" "$prefix/bin/ferry" "$prefix/include/ferry/ferry.hpp"; do
  [ -e "$f" ] || fail "not installed: ${f#$prefix/}"
done
headers=$(cd "$prefix/include" && ls ferry/*.hpp)
[ "$(echo "$headers" | wc -l)" -ge 8 ] || fail "too few headers: $headers"

step "exports"
nm -D --defined-only "$libdir/libferry.so" | awk '{print $3}' | c++filt >"$work/exports.txt"
n=$(wc -l <"$work/exports.txt")
[ "$n" -gt 40 ] || fail "only $n symbols exported"
if grep -Ev '^(ferry::|typeinfo for ferry::|typeinfo name for ferry::|vtable for ferry::)' "$work/exports.txt" >"$work/foreign.txt"; then
  head -20 "$work/foreign.txt" >&2
  fail "$(wc -l <"$work/foreign.txt") exported symbol(s) outside namespace ferry"
fi
for want in 'ferry::runtime::Runtime::load()' 'ferry::runtime::Config::set(' 'typeinfo for ferry::Error' \
            'ferry::runtime::to_dlpack(' 'ferry::runtime::use_registry(' 'ferry::version()'; do
  grep -qF "$want" "$work/exports.txt" || fail "not exported: $want"
done
for hidden in 'Runtime::Impl' 'LoadHandle::State::' 'ConfigBuilder' 'RuntimeTestSeams' 'make_runtime' \
              'RuntimeFactory' 'to_config' 'actors::' 'io::' 'models::' 'gpu::'; do
  exported=$(grep -F "$hidden" "$work/exports.txt" | grep -v '^ferry::runtime::LoadedModel::LoadedModel' || true)
  if [ -n "$exported" ]; then
    fail "an internal symbol is exported: $(grep -F "$hidden" "$work/exports.txt" | head -1)"
  fi
done
needed=$(readelf -d "$libdir/libferry.so" | grep NEEDED)
for lib in libcaf_core liburing libprometheus-cpp-core; do
  echo "$needed" | grep -q "$lib" || fail "libferry.so does not depend on $lib"
done
echo "$n symbols, all in namespace ferry"

step "headers"
for h in $headers; do
  printf '#include <%s>\n#include <%s>\nint main() { return 0; }\n' "$h" "$h" >"$work/one.cpp"
  "$cxx" -std=c++20 -Wall -Wextra -Wpedantic -Werror -I"$prefix/include" -c "$work/one.cpp" \
    -o "$work/one.o" -MD -MF "$work/one.d" || fail "$h does not compile alone"
  deps=$(tr ' \\' '\n\n' <"$work/one.d" | grep -v '^$' | tail -n +3)
  if echo "$deps" | grep -F "$src/" | grep -q .; then
    fail "$h includes from ferry's tree: $(echo "$deps" | grep -F "$src/" | head -1)"
  fi
  if echo "$deps" | grep -Eq '/(caf|nlohmann|liburing)[/.]'; then
    fail "$h includes $(echo "$deps" | grep -E '/(caf|nlohmann|liburing)[/.]' | head -1)"
  fi
  if [ "$h" != ferry/metrics.hpp ] && echo "$deps" | grep -q '/prometheus/'; then
    fail "$h includes prometheus-cpp"
  fi
done
{ for h in $headers; do echo "#include <$h>"; done; echo 'int main() { return 0; }'; } >"$work/all.cpp"
"$cxx" -std=c++20 -Werror -Wall -I"$prefix/include" -c "$work/all.cpp" -o "$work/all.o" ||
  fail "the headers do not compile together"
echo "$(echo "$headers" | wc -l) headers compile alone and together"

step "pkg-config"
cat >"$work/pc.cpp" <<'CPP'
#include <cstdio>
#include <ferry/ferry.hpp>
int main() {
  ferry::runtime::Config c;
  c.set("parallel.tp", "4");
  std::printf("ferry %s, %s\n", std::string(ferry::version()).c_str(),
              c.to_json(-1).find("\"tp\":4") != std::string::npos ? "tp 4" : "tp not set");
  return c.to_json(-1).find("\"tp\":4") != std::string::npos ? 0 : 1;
}
CPP
flags=$(PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --cflags --libs ferry)
# shellcheck disable=SC2086
"$cxx" "$work/pc.cpp" -o "$work/pc" $flags || fail "pkg-config flags: $flags"
LD_LIBRARY_PATH=$libdir "$work/pc" || fail "the pkg-config program"

step "find_package(ferry): examples/engine_boot and a ferry::metrics consumer"
"$prefix/bin/ferry" synth --family llama --preset tiny --out "$work/ck" >/dev/null
for project in "$src/examples/engine_boot" "$src/tests/package/consumer"; do
  name=$(basename "$project")
  cmake -S "$project" -B "$work/$name" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; fail "configure $name"; }
  cmake --build "$work/$name" >>"$work/$name.log" 2>&1 || { cat "$work/$name.log"; fail "build $name"; }
  grep -q "$prefix" "$work/$name/CMakeCache.txt" || fail "$name did not find the prefix's ferry"
done
# ldd's output whole, then matched: under pipefail, `ldd | grep -q` fails whenever grep
# quits at the match before ldd has written the rest (SIGPIPE).
linked=$(ldd "$work/engine_boot/engine_boot")
grep -q "$libdir/libferry.so" <<<"$linked" || fail "engine_boot is not linked to the prefix's libferry.so"
"$work/engine_boot/engine_boot" "$work/ck" --mode overlap parallel.tp=2 || fail "engine_boot (overlap)"
"$work/engine_boot/engine_boot" "$work/ck" --mode serial || fail "engine_boot (serial)"
"$work/consumer/metrics_consumer" "$work/ck" || fail "metrics_consumer"
echo "package_test: ok"
