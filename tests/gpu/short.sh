#!/usr/bin/env bash
# The GPU checks in two commands of under ten minutes each, for a
# time-boxed GPU machine with no network and PyTorch installed for python3
# (headers from .gpudeps/: tests/gpu/make-deps.sh). Run them one after the
# other on the same machine: the second reuses the first's build-gpu/.
#
#   tests/gpu/short.sh tests OUT   # build, test_cuda, the GPU-relevant tests
#                                  # with CUDA ranks (tests/gpu/run.sh)
#   tests/gpu/short.sh bench OUT [ROUNDS]
#                                  # the step benchmarks (bench/gpu/run.sh):
#                                  # fused ops alone, GPT-2 medium and
#                                  # Llama 3.2 1B ours against PyTorch eager,
#                                  # profiles; ROUNDS (default 3) GPT-2 rounds
#   tests/gpu/short.sh scale OUT [MODEL]
#                                  # 7B-class fine-tuning (bench/gpu/run.sh
#                                  # --scale): Gemini static with and without
#                                  # overlap_host_step, MODEL (default
#                                  # llama3-8b), 3 timed steps each
#
# Each writes its logs and JSON under /tmp/gpu-<stage>, a tarball of them
# and its summary into OUT, and prints the summary last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

stage=${1:-}
out=${2:-}
if [ -z "$stage" ] || [ -z "$out" ]; then
  sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
mkdir -p "$out"
[ -d .gpudeps ] && export CMAKE_PREFIX_PATH="$PWD/.gpudeps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
dir=/tmp/gpu-$stage
rm -rf "$dir"
mkdir -p "$dir"

# bench/gpu/run.sh ARGS... in a 540 s box, then REPORT (bench/gpu/REPORT_SCRIPT
# writes it) and the log's tail; sets rc and summary.
bench_stage() {
  local script=$1 report=$2
  shift 2
  PYTHON=python3 BUILD_DIR=build-gpu timeout -k 10 540 bench/gpu/run.sh --out-dir "$dir" \
    "$@" > "$dir/bench-gpu.log" 2>&1
  rc=$?
  # A run stopped by the time box leaves its results without a report.
  [ -f "$dir/$report" ] || python3 "bench/gpu/$script" "$dir" >/dev/null 2>&1
  summary=$dir/$report
  tail -30 "$dir/bench-gpu.log"
}

case "$stage" in
  tests)
    # test_cuda always runs; these are the programs whose GPU paths are
    # newest (kernels, host reads, attention kernels, optimizers, plugins).
    timeout -k 10 560 tests/gpu/run.sh --python python3 --out-dir "$dir" \
      --tests '^(test_kernels|test_host_syncs|test_zoo|test_hybrid_adam|test_booster|test_low_level_zero|test_gemini|test_fp8_training)$' \
      --skip-example --skip-bench --stage-timeout 320
    rc=$?
    summary=$dir/gpu-tests.md
    ;;
  bench)
    rounds=${3:-3}
    bench_stage report.py report.md --rounds "$rounds" --steps 10 --llama-rounds 1 \
      --only '^(ops|ours_zero1_bf16|ours_zero1_bf16_graph|ours_zero1_bf16_fp8|ours_fused|torch|torch_fused|llama_ours_fused|llama_ours_fused_recompute|llama_ours_fused_cast_each|llama_ours_fused_graph|llama_ours_fused_sdpa_cudnn|llama_ours_zero1_bf16|llama_ours_zero1_bf16_fp8|llama_torch_fused|profile_ours_zero1_bf16|profile_llama_ours_fused)$'
    ;;
  scale)
    model=${3:-llama3-8b}
    bench_stage scale_report.py scale.md \
      --rounds 0 --scale "$model" --scale-args "--steps 3 --warmup 1 --split-steps 1" \
      --only "^scale_${model}_(gemini_static|gemini_static_overlap)\$"
    ;;
  *)
    echo "tests/gpu/short.sh: the stage is tests, bench or scale, got $stage" >&2
    exit 2
    ;;
esac
tar czf "$out/gpu-$stage.tgz" -C /tmp "gpu-$stage"
[ -f "$summary" ] && cp "$summary" "$out/" && cat "$summary"
exit $rc
