#!/usr/bin/env bash
# Everything that needs a GPU, in one command, for a machine with an NVIDIA
# GPU (the suite's CPU runs skip these parts and say so):
#   1. builds against the CUDA LibTorch of the pinned PyPI wheel
#      (scripts/setup.sh --torch pip, into build-pip/);
#   2. test_cuda: device selection, CUDA tensors over Gloo (two ranks on one
#      GPU), NCCL at world size 1 (and a dead peer as a DistributedError
#      with two GPUs), every data-parallel plugin on CUDA in fp32, fp16 and
#      bf16, HybridAdam's CUDA path;
#   3. the whole suite with CUDA tensors (COLOSSALAI_DEVICE=cuda: every
#      rank on a GPU, Gloo over CUDA tensors between ranks);
#   4. the Fashion-MNIST main job on the GPU (NCCL, one rank);
#   5. bench/gpu: GPT-2-medium bf16 step time, tokens/s and MFU against
#      the same step in PyTorch eager from the same wheel.
# Logs and a summary go to bench/results/<date>-gpu/ (--out-dir DIR).
#
# --python PY builds instead against the torch already installed for PY (a
# machine with no network: no set-up, no pip) into build-gpu/; headers the
# build needs (Gloo, GTest, CLI11, nlohmann-json, zlib) are looked up in
# CMAKE_PREFIX_PATH as usual (tests/gpu/make-deps.sh copies them from a
# Debian machine's packages into .gpudeps/ to carry there). --stage-timeout
# S stops any one part after S seconds (the summary says so) so that a
# time-boxed run still reports;
# --jobs N runs N suites at once; --exclude RE leaves out ctest's matches;
# --tests RE builds (with --python) and runs only the test programs whose
# names match RE (test_cuda always); --bench-args "ARGS" go to bench/gpu.
#
#   tests/gpu/run.sh [--out-dir DIR] [--skip-suite] [--skip-bench] [--skip-example]
#                    [--python PY] [--stage-timeout S] [--jobs N] [--exclude RE]
#                    [--tests RE] [--bench-args "ARGS"]
set -uo pipefail
cd "$(dirname "$0")/../.."

out_dir=""
suite=1
bench=1
example=1
python=""
stage_timeout=0
jobs=4
exclude=()
tests_re=""
bench_args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out-dir) out_dir="$2"; shift ;;
    --skip-suite) suite=0 ;;
    --skip-bench) bench=0 ;;
    --skip-example) example=0 ;;
    --python) python="$2"; shift ;;
    --stage-timeout) stage_timeout="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --exclude) exclude=(-E "$2"); shift ;;
    --tests) tests_re="$2"; shift ;;
    --bench-args) bench_args="$2"; shift ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "tests/gpu/run.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
out_dir=${out_dir:-bench/results/$(date +%F)-gpu}
mkdir -p "$out_dir"
summary="$out_dir/gpu-tests.md"
say() { printf '[gpu] %s\n' "$*"; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: no NVIDIA GPU visible (nvidia-smi -L fails)" >&2
  exit 1
fi
# Each part runs under `limited` (coreutils timeout when --stage-timeout is set).
limited() {
  if [ "$stage_timeout" -gt 0 ]; then timeout -k 10 "$stage_timeout" "$@"; else "$@"; fi
}
if [ -z "$python" ]; then
  ./scripts/setup.sh --torch pip || { echo "tests/gpu/run.sh: set-up failed" >&2; exit 1; }
  python=.venv/bin/python
  build=build-pip
else
  build=build-gpu
  prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)') || {
    echo "tests/gpu/run.sh: $python has no torch" >&2; exit 1; }
  arch=$("$python" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}.{n}")')
  # The wheel's CMake package needs nvcc; CUDA's default place need not be on PATH.
  command -v nvcc >/dev/null || [ ! -x /usr/local/cuda/bin/nvcc ] || export PATH="$PATH:/usr/local/cuda/bin"
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  say "configuring $build against $prefix (CUDA arch $arch)"
  if ! TORCH_CUDA_ARCH_LIST=$arch cmake -S . -B "$build" "${generator[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      -DCOLOSSALAI_PYTHON="$(command -v "$python")" >"$out_dir/build.log" 2>&1; then
    tail -40 "$out_dir/build.log" >&2; exit 1
  fi
  targets=()
  if [ -n "$tests_re" ]; then
    # Every benchmark bench/gpu/run.sh builds, so that a later call with
    # --skip-suite (a warm machine keeps build-gpu/) starts timing at once.
    # shellcheck disable=SC2207
    targets=(--target test_cuda train_fashion_mnist bench_gpu_gpt_step bench_gpu_ops bench_load_pretrained
      bench_gpu_scale_step bench_gpu_qlora_step
      $(ls tests/test_*.cpp | sed 's|.*/||; s|\.cpp$||' | grep -E "$tests_re"))
  fi
  say "building $build ($(nproc) jobs) ${targets[*]}"
  if ! limited cmake --build "$build" -j "$(nproc)" "${targets[@]}" >>"$out_dir/build.log" 2>&1; then
    grep -m20 -E "error|Error" "$out_dir/build.log" >&2 || tail -40 "$out_dir/build.log" >&2
    exit 1
  fi
fi
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
  echo "tests/gpu/run.sh: $python's torch sees no GPU (driver too old for its CUDA?)" >&2
  exit 1
}

{
  echo "# GPU run, $(date -u +%F)"
  echo
  nvidia-smi -L | sed 's/^/    /'
  "$python" -c 'import torch; print(f"    torch {torch.__version__}, CUDA {torch.version.cuda}")'
  echo
  echo "| part | result | log |"
  echo "|---|---|---|"
} > "$summary"
status=0
record() { # name, exit code, log
  local r=pass
  [ "$2" -ne 0 ] && { r="FAIL (exit $2)"; status=1; }
  [ "$2" -eq 124 ] && r="stopped after ${stage_timeout} s (--stage-timeout)"
  echo "| $1 | $r | $(basename "$3") |" >> "$summary"
  say "$1: $r"
}

say "test_cuda"
limited "./$build/tests/test_cuda" > "$out_dir/test_cuda.log" 2>&1
record "test_cuda (GPU-only tests)" $? "$out_dir/test_cuda.log"

if [ "$suite" = 1 ]; then
  say "the suite with CUDA tensors"
  only=()
  [ -n "$tests_re" ] && only=(-R "$tests_re")
  COLOSSALAI_DEVICE=cuda limited ctest --test-dir "$build" --output-on-failure -j "$jobs" \
    "${exclude[@]}" "${only[@]}" \
    > "$out_dir/suite-cuda.log" 2>&1
  record "suite, COLOSSALAI_DEVICE=cuda" $? "$out_dir/suite-cuda.log"
fi

if [ "$example" = 1 ]; then
  say "Fashion-MNIST on the GPU"
  COLOSSALAI_DEVICE=cuda limited "./$build/examples/train_fashion_mnist" --nproc 1 --plugin none \
    > "$out_dir/fashion_mnist.log" 2>&1
  record "Fashion-MNIST main job (one rank, CUDA)" $? "$out_dir/fashion_mnist.log"
fi

if [ "$bench" = 1 ]; then
  say "bench/gpu"
  # The arguments as the shell would split and unquote them (a quoted
  # --only regex reaches bench/gpu/run.sh without its quotes).
  eval "bench_argv=($bench_args)"
  PYTHON=$python BUILD_DIR=$build limited bench/gpu/run.sh --out-dir "$out_dir" "${bench_argv[@]}" \
    > "$out_dir/bench-gpu.log" 2>&1
  record "bench/gpu (report.md)" $? "$out_dir/bench-gpu.log"
fi
cat "$summary"
exit $status
