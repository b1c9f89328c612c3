#!/usr/bin/env bash
# Builds the safetensors header fuzzer with libFuzzer, ASan and UBSan, then
# runs it on a copy of the seed corpus.
#
#   fuzz/run.sh [SECONDS]   (default 20)
#
# Needs clang and libFuzzer (Debian: clang, libclang-rt-14-dev) and LibTorch
# under /usr. The binary and any crash inputs go to $FUZZ_BUILD_DIR (default
# build/fuzz). Exits non-zero when the fuzzer finds a crash.
set -euo pipefail

seconds="${1:-20}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${FUZZ_BUILD_DIR:-$repo/build/fuzz}"
cxx="${FUZZ_CXX:-clang++}"
torch_include="${TORCH_INCLUDE:-/usr/include}"
mkdir -p "$out"

sources=("$repo/fuzz/safetensors_fuzz.cpp" "$repo/src/checkpoint_io/safetensors.cpp")
binary="$out/safetensors_fuzz"
rebuild=0
if [[ ! -x "$binary" ]]; then
  rebuild=1
else
  for f in "${sources[@]}" "$repo/include/colossalai/checkpoint_io/safetensors.h"; do
    [[ "$f" -nt "$binary" ]] && rebuild=1
  done
fi
if (( rebuild )); then
  echo "building $binary"
  start=$(date +%s)
  "$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$repo/include" -I"$torch_include" -I"$torch_include/torch/csrc/api/include" \
    "${sources[@]}" -o "$binary" \
    -ltorch -ltorch_cpu -lc10
  echo "built in $(( $(date +%s) - start )) s"
fi

corpus="$(mktemp -d)"
trap 'rm -rf "$corpus"' EXIT
cp "$repo"/fuzz/corpus/safetensors/* "$corpus"/

"$binary" -max_total_time="$seconds" -max_len=4096 -timeout=10 \
  -dict="$repo/fuzz/safetensors.dict" -artifact_prefix="$out/" "$corpus"
