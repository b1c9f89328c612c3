#!/usr/bin/env bash
# The GPU variant of the benchmark suite, for a machine with an NVIDIA GPU and
# a PyTorch 2.x wheel (CUDA) installed: builds this project against the
# LibTorch inside that wheel, runs the gpt2-medium-gpu training step (bf16)
# through our Booster and the same step in plain PyTorch eager (Python),
# alternating the programs, and writes JSON + report.md into
# bench/results/<date>-gpu/.
#
#   bench/gpu/run.sh [--out-dir DIR] [--batch 8] [--steps 20] [--pairs 2]
#
# Environment: PYTHON (default python3) is the interpreter with the wheel;
# BUILD_DIR (default build-gpu). Needs cmake, a C++17 compiler, zlib headers
# and the CUDA toolkit (nvcc) matching the wheel, which the wheel's CMake
# package requires; pip's nvidia-cuda-nvcc package is found too.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build-gpu}
out_dir=""
batch=8
steps=20
pairs=2
while [ $# -gt 0 ]; do
  case "$1" in
    --out-dir) out_dir="$2"; shift ;;
    --batch) batch="$2"; shift ;;
    --steps) steps="$2"; shift ;;
    --pairs) pairs="$2"; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/gpu/run.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
out_dir=${out_dir:-bench/results/$(date +%F)-gpu}
mkdir -p "$out_dir"
say() { printf '[gpu-bench] %s\n' "$*"; }

# ---- the wheel -----------------------------------------------------------------
"$PY" - <<'EOF' || { echo "bench/gpu/run.sh: $PY needs torch with CUDA and a visible GPU" >&2; exit 1; }
import torch, sys
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
torch_lib=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
arch=$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}.{n}")')
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}

# nvcc: PATH, CUDA_HOME, /usr/local/cuda, or pip's nvidia-cuda-nvcc package.
nvcc=$(command -v nvcc || true)
for c in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
  [ -z "$nvcc" ] && [ -x "$c" ] && nvcc=$c
done
if [ -z "$nvcc" ]; then
  nvcc=$("$PY" -c 'import glob, os, nvidia; print(next(iter(glob.glob(os.path.join(list(nvidia.__path__)[0], "cuda_nvcc", "bin", "nvcc"))), ""))' 2>/dev/null || true)
fi
cmake_cuda=()
if [ -n "$nvcc" ]; then
  say "nvcc: $nvcc"
  cmake_cuda=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCUDAToolkit_ROOT="$(dirname "$(dirname "$nvcc")")")
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}
else
  say "no nvcc found: the wheel's CMake package may fail to configure (set CUDA_HOME)"
fi

# ---- build -----------------------------------------------------------------------
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then
  # Already configured (tests/gpu/run.sh builds everything there first).
  say "reusing the configured $BUILD_DIR (log: $out_dir/build.log)"
  : >>"$out_dir/build.log"
else
  say "configuring $BUILD_DIR against $prefix (log: $out_dir/build.log)"
  if ! cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" "${cmake_cuda[@]}" \
      -DCOLOSSALAI_BUILD_TESTS=OFF -DCOLOSSALAI_BUILD_EXAMPLES=OFF \
      -DCOLOSSALAI_USE_PCH=OFF >"$out_dir/build.log" 2>&1; then
    tail -40 "$out_dir/build.log" >&2
    exit 1
  fi
fi
grep -m1 "ColossalAI: LibTorch" "$out_dir/build.log" || true
say "building bench_gpu_gpt_step"
if ! cmake --build "$BUILD_DIR" -j "$(nproc)" --target bench_gpu_gpt_step >>"$out_dir/build.log" 2>&1; then
  grep -m20 -E "error" "$out_dir/build.log" >&2 || tail -40 "$out_dir/build.log" >&2
  exit 1
fi
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---- run: ours and PyTorch's, alternated ---------------------------------------------
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  >"$out_dir/nvidia-smi.csv" 2>/dev/null || true
common=(--device cuda --model gpt2-medium --batch "$batch" --steps "$steps" --warmup 3)
for i in $(seq 1 "$pairs"); do
  say "pair $i/$pairs: ours (C++)"
  "$BUILD_DIR/bench/bench_gpu_gpt_step" "${common[@]}" --out "$out_dir/ours_$i.json" \
    >"$out_dir/ours_$i.log" 2>&1 || { tail -20 "$out_dir/ours_$i.log" >&2; exit 1; }
  tail -1 "$out_dir/ours_$i.log"
  say "pair $i/$pairs: PyTorch eager, default AdamW"
  "$PY" bench/gpu/torch_gpt_step.py "${common[@]}" --out "$out_dir/torch_$i.json" \
    >"$out_dir/torch_$i.log" 2>&1 || { tail -20 "$out_dir/torch_$i.log" >&2; exit 1; }
  say "pair $i/$pairs: PyTorch eager, AdamW foreach off (a per-tensor loop, as LibTorch's)"
  "$PY" bench/gpu/torch_gpt_step.py "${common[@]}" --foreach off \
    --out "$out_dir/torch_loop_$i.json" >"$out_dir/torch_loop_$i.log" 2>&1 ||
    { tail -20 "$out_dir/torch_loop_$i.log" >&2; exit 1; }
done
"$PY" bench/gpu/report.py "$out_dir"
say "report: $out_dir/report.md"
