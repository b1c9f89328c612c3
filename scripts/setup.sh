#!/usr/bin/env bash
# Installs the Debian packages the project needs (when missing) and builds it
# (Release). Safe to run again: it only installs what is missing and rebuilds
# what changed.
#
#   ./scripts/setup.sh              Debian's LibTorch (1.13 on Debian 12,
#                                   2.6 on Debian 13), built in ./build
#   ./scripts/setup.sh --torch pip  LibTorch 2.x from PyPI's torch wheel (the
#                                   pin in scripts/requirements-torch.txt),
#                                   installed into ./.venv, built in
#                                   ./build-pip
#   --tests                         also the test suite's Python references:
#                                   ./.venv with that torch (and its
#                                   torchrun) and transformers, peft,
#                                   safetensors (scripts/requirements-
#                                   hf.txt), and OpenMPI's mpirun (the
#                                   launcher tests); implied by --torch pip
#   --colossalai                    also Python ColossalAI, in its own
#                                   ./.venv-colossalai (scripts/requirements-
#                                   colossalai.txt: it pins an older torch),
#                                   for `ctest -L colossalai`
#
# The wheels are kept in ${XDG_CACHE_HOME:-~/.cache}/colossalai-cpp/wheels,
# outside the tree: a second set-up on the same machine downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_source=system
tests=0
colossalai=0
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) torch_source=${2:-}; shift 2 || true ;;
    --torch=*) torch_source=${1#--torch=}; shift ;;
    --tests) tests=1; shift ;;
    --colossalai) colossalai=1; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$1' (--torch system|pip, --tests, --colossalai)" >&2; exit 2 ;;
  esac
done
case "$torch_source" in
  system|pip) ;;
  *) echo "setup.sh: --torch takes 'system' or 'pip', got '$torch_source'" >&2
     exit 2 ;;
esac

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
updated=0
install_missing() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" ||
      missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "== installing: ${missing[*]}"
  if [ $updated -eq 0 ]; then
    $sudo apt-get update -qq
    updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
    --no-install-recommends "${missing[@]}"
}

packages=(
  build-essential cmake ccache
  libtorch-dev libgloo-dev libopenblas0-pthread
  libgtest-dev zlib1g-dev nlohmann-json3-dev libcli11-dev
  clang python3-torch
  dataset-fashion-mnist python3-matplotlib iproute2 fortunes
)
[ "$torch_source" = pip ] && tests=1
[ $tests -eq 1 ] && packages+=(python3-venv openmpi-bin)
[ $colossalai -eq 1 ] && packages+=(python3-venv)
install_missing "${packages[@]}"
# The fuzz targets' sanitizer runtime is versioned like clang itself (14 on
# Debian 12, 19 on Debian 13).
clang_major=$(clang --version | sed -n 's/.*clang version \([0-9][0-9]*\).*/\1/p' |
  head -n 1)
install_missing "libclang-rt-${clang_major}-dev"

# The venv: PyPI's torch (LibTorch 2.x for --torch pip; the hf tests'
# transformers runs on it whichever LibTorch the C++ build uses) and the
# Hugging Face references. Pinned wheels, downloaded once into the cache.
python=/usr/bin/python3
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/colossalai-cpp/wheels"
install_venv() {
  local reqs=(-r scripts/requirements-torch.txt -r scripts/requirements-hf.txt)
  mkdir -p "$wheels"
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  if ! .venv/bin/pip install -q --disable-pip-version-check --no-index \
      --find-links "$wheels" "${reqs[@]}" 2>/dev/null; then
    echo "== downloading the pinned wheels into $wheels"
    .venv/bin/pip download -q --disable-pip-version-check \
      --only-binary=:all: -d "$wheels" "${reqs[@]}"
    .venv/bin/pip install -q --disable-pip-version-check --no-index \
      --find-links "$wheels" "${reqs[@]}"
  fi
}

# ColossalAI's venv: the pinned wheels, then ColossalAI itself, which PyPI
# has as a source archive only (built against the venv's setuptools and
# torch, without its declared dependencies).
install_colossalai_venv() {
  local reqs=scripts/requirements-colossalai.txt binaries
  local pin
  if ! "$python" -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
    echo "setup.sh: --colossalai needs Python 3.11 or older (Debian 12's), not" >&2
    echo "  $("$python" -V): ColossalAI 0.5.0 is a source archive built with the" >&2
    echo "  venv's setuptools (newer venvs have none), and its torch 2.5.1 has no" >&2
    echo "  wheels past Python 3.12." >&2
    exit 1
  fi
  pin=$(grep -E '^colossalai==' "$reqs")
  binaries=$(mktemp)
  grep -v -E '^colossalai==' "$reqs" >"$binaries"
  mkdir -p "$wheels"
  [ -x .venv-colossalai/bin/python ] || "$python" -m venv .venv-colossalai
  local pip=(.venv-colossalai/bin/pip -q --disable-pip-version-check)
  if ! "${pip[@]}" install --no-index --find-links "$wheels" --no-deps \
      -r "$binaries" 2>/dev/null; then
    echo "== downloading ColossalAI's pinned wheels into $wheels"
    "${pip[@]}" download --only-binary=:all: --no-deps -d "$wheels" -r "$binaries"
    "${pip[@]}" install --no-index --find-links "$wheels" --no-deps -r "$binaries"
  fi
  rm -f "$binaries"
  if ! .venv-colossalai/bin/python -c 'import colossalai' 2>/dev/null; then
    "${pip[@]}" download --no-binary=:all: --no-deps -d "$wheels" "$pin" \
      2>/dev/null || true
    "${pip[@]}" install --no-index --find-links "$wheels" --no-deps \
      --no-build-isolation "$pin"
  fi
}
if [ $colossalai -eq 1 ]; then
  echo "== Python ColossalAI in ./.venv-colossalai"
  install_colossalai_venv
fi

if [ "$torch_source" = system ]; then
  if [ $tests -eq 1 ]; then
    echo "== the test references' Python in ./.venv"
    install_venv
  fi
  echo "== configuring and building (Release, Debian's LibTorch) in ./build"
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build -j "$(nproc)"
  echo "== build done"
  exit 0
fi

# LibTorch from PyPI's torch wheel. It is a CUDA build: CMake configures
# against it only with a CUDA toolkit (nvcc and headers) present, even on a
# machine without a GPU.
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup.sh: --torch pip needs the CUDA toolkit (nvcc): PyPI's LibTorch is a" >&2
  echo "  CUDA build and its CMake files look for it. Install NVIDIA's CUDA toolkit" >&2
  echo "  (or Debian's nvidia-cuda-toolkit, non-free), or use Debian's LibTorch" >&2
  echo "  (./scripts/setup.sh without --torch pip)." >&2
  exit 1
fi
install_venv
prefix=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
echo "== configuring and building (Release, LibTorch $(.venv/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null) from PyPI) in ./build-pip"
cmake -S . -B build-pip -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" \
  -DCOLOSSALAI_PYTHON="$PWD/.venv/bin/python" >/dev/null
cmake --build build-pip -j "$(nproc)"
echo "== build done"
