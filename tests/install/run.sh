#!/usr/bin/env bash
# Installs the build in BUILD_DIR into a scratch prefix, builds
# tests/install/ (a program outside the tree) against it, and runs it on 4
# ranks with the installed launcher on a transformers-written LLaMA.
#
#   tests/install/run.sh BUILD_DIR HF_PYTHON [CMAKE_ARGS...]
#
# CMAKE_ARGS reach the program's configure (e.g. -DTorch_DIR=... for a
# LibTorch outside the system's paths).
set -euo pipefail
build=$1 python=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/colossalai_install.XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$here" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" "$@" >/dev/null
cmake --build "$work/build" >/dev/null
"$python" "$here/../python/hf_models.py" make "$work/hf" >/dev/null 2>&1
# A free port: 29500, the launcher's default, may be another test's.
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$work/prefix/bin/colossalai" run --nproc_per_node 4 --master_port "$port" \
  "$work/build/train_llama" "$work/hf/llama3"
