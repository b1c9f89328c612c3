#!/usr/bin/env bash
# Assembles a prefix (default .gpudeps/) with what a `tests/gpu/run.sh
# --python` build needs besides the torch wheel, for a GPU machine with no
# network and no Debian development packages: Gloo's, CLI11's,
# nlohmann-json's and zlib's headers, GTest's headers, static libraries and
# CMake package, and zlib's static library, copied from this machine's
# Debian packages (scripts/setup.sh --tests installs them). The layout is
# Debian's, so GTest's CMake package finds its files relative to itself.
# Carry the folder to the GPU machine and put it on CMAKE_PREFIX_PATH:
#
#   tests/gpu/make-deps.sh   # .gpudeps/ is ignored by git
#   # there: export CMAKE_PREFIX_PATH=$PWD/.gpudeps; tests/gpu/run.sh --python python3
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.gpudeps}
arch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
lib=/usr/lib/$arch
for f in /usr/include/gloo/algorithm.h /usr/include/CLI/CLI.hpp \
  /usr/include/nlohmann/json.hpp /usr/include/zlib.h /usr/include/gtest/gtest.h \
  "$lib/libgtest.a" "$lib/libz.a" "$lib/cmake/GTest/GTestConfig.cmake"; do
  [ -e "$f" ] || { echo "make-deps: $f is missing (scripts/setup.sh --tests installs it)" >&2; exit 1; }
done
rm -rf "$out"
mkdir -p "$out/include" "$out/lib/$arch/cmake"
cp -r /usr/include/gloo /usr/include/CLI /usr/include/nlohmann \
  /usr/include/gtest /usr/include/zlib.h /usr/include/zconf.h "$out/include/"
[ -d /usr/include/gmock ] && cp -r /usr/include/gmock "$out/include/"
cp "$lib"/libgtest*.a "$lib/libz.a" "$out/lib/$arch/"
cp "$lib"/libgmock*.a "$out/lib/$arch/" 2>/dev/null || true
cp -r "$lib/cmake/GTest" "$out/lib/$arch/cmake/"
echo "make-deps: $(du -sh "$out" | cut -f1) in $out"
