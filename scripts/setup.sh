#!/usr/bin/env bash
# Installs the Debian 12 packages the project needs (when missing) and builds
# it in ./build (Release). Safe to run again: it only installs what is missing
# and rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ccache
  libtorch-dev libgloo-dev libopenblas0-pthread
  libgtest-dev zlib1g-dev nlohmann-json3-dev libcli11-dev
  clang libclang-rt-14-dev python3-torch
  dataset-fashion-mnist python3-matplotlib iproute2
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" ||
    missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
    --no-install-recommends "${missing[@]}"
fi

echo "== configuring and building (Release) in ./build"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"
echo "== build done"
