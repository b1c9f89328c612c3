#!/usr/bin/env bash
# The GPU variant of the benchmark suite, for a machine with an NVIDIA GPU and
# a PyTorch 2.x wheel (CUDA) installed: builds this project against the
# LibTorch inside that wheel, runs the gpt2-medium-gpu training step (bf16)
# through our Booster and the same step in plain PyTorch eager (Python),
# alternating the programs, and writes JSON + report.md into
# bench/results/<date>-gpu/.
#
#   bench/gpu/run.sh [--out-dir DIR] [--batch 8] [--steps 20] [--rounds 2]
#                    [--llama-rounds N] [--compile] [--only RE] [--load MODEL]
#                    [--scale MODELS] [--scale-args "ARGS"] [--qlora MODELS]
#
# Each round runs, one after the other: ours with LibTorch's AdamW and the
# whole logits (ours), with FusedAdamW (ours_fused_adamw), with FusedAdamW
# and the fused linear + cross-entropy (ours_fused), and the same two under
# LowLevelZero stage 1 in bf16 at world size one (bf16 weights, fp32
# masters, no autocast: ours_zero1_bf16_logits, ours_zero1_bf16; the last
# with each MLP's activation recomputed in backward: ours_zero1_bf16_recompute;
# the same step captured once in a CUDA graph and replayed:
# ours_zero1_bf16_graph); fp16 with dynamic loss scaling, its overflow
# verdict left on the device (autocast: ours_fp16; LowLevelZero's fp16
# weights in a CUDA graph: ours_zero1_fp16_graph); PyTorch
# eager with its default AdamW (torch), with AdamW(fused=True)
# (torch_fused) and the same in fp16 with its GradScaler
# (torch_fused_fp16); then GPT-2 medium as transformers' GPT2LMHeadModel
# (tied head, vocabulary 50257): ours with the transformers-compatible
# models::GPT2LMHeadModel and the fused loss, autocast (hf_ours_fused) and
# LowLevelZero bf16 (hf_ours_zero1_bf16), and transformers' own model in
# PyTorch eager with AdamW(fused=True) (hf_torch_fused); last, ours_zero1_bf16
# with its linears in FP8 (use_fp8: ours_zero1_bf16_fp8).
# --llama-rounds N adds N rounds of a Llama-3.2-1B-shaped model (batch
# 4 x 2048): ours with AdamW, FusedAdamW (whole logits, fused loss, the
# fused loss with the MLPs' product recomputed: llama_ours_fused_recompute;
# the fused loss in a CUDA graph: llama_ours_fused_graph; the fused loss
# with attention on SDPA's flash or cuDNN kernel alone:
# llama_ours_fused_sdpa_flash, llama_ours_fused_sdpa_cudnn; the fused loss
# with autocast casting each linear's input itself, as before shared casts:
# llama_ours_fused_cast_each), LowLevelZero bf16
# (fused loss); transformers' LlamaForCausalLM with
# AdamW(fused=True); last, LowLevelZero bf16 with use_fp8
# (llama_ours_zero1_bf16_fp8).
# --compile adds one torch.compile run (fused AdamW) after the rounds, of
# each model the rounds ran.
# Before the rounds, bench_gpu_ops times each fused op alone against its
# ATen composition (ops.json; its name for --only is "ops").
# After the rounds, one run each of our main variants under LibTorch's
# profiler gives the device time per step by kind of kernel
# (profile_<variant>.json; "profile_<variant>" for --only).
# --only RE keeps the variants whose names match the extended regex RE.
# --load MODEL (llama-1b, llama2-7b, llama3-8b) writes that directory and
# times from_pretrained against a plain read of its files, with the host
# peak (bench_load_pretrained; load.json).
# --scale MODELS (comma-separated: llama2-7b, llama3-8b) fine-tunes each at
# seq 4096 with every layer checkpointed, one run per setup: ours with
# Gemini's static placement (the host share its memory formula needs), the
# same with overlap_host_step (the host chunks' HybridAdam steps during the
# backward), with auto placement and gpu_margin_mem_ratio 0.8 (and with
# overlap_host_step), with ZeRO-2 cpu_offload (and with overlap_host_step), and
# with ZeRO-2 all on the device (16 bytes a parameter with bf16 gradient
# shards: LLaMA-2-7B's 108 GB fit an H200) (bench_gpu_scale_step), and
# PyTorch FSDP2 +
# CPUOffloadPolicy on transformers' model (fsdp2_peer.py); a setup that
# does not fit says so. scale_<model>_<setup>.json, then scale.json and
# scale.md (with load.json's numbers). Names for --only:
# scale_<model>_<setup>; --rounds 0 --only '^scale_' runs these alone.
# --scale-args "ARGS" go to each of those runs (ours and the peer), e.g.
# "--batch 2 --steps 3 --warmup 1" (both take --batch, --seq, --steps,
# --warmup).
# --qlora MODELS (llama3-8b, llama2-7b) trains LoRA adapters (r 16) on a
# 4-bit NF4 base, batch 4 x 2048, every layer recomputed: ours
# (bench_gpu_qlora_step) and transformers + PEFT (qlora_peer.py: NF4 through
# bitsandbytes where it works, else a bf16 base, named in its JSON);
# qlora_<model>_ours.json, qlora_<model>_peer.json, and scale.json's
# "qlora".
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
compile=0
llama_rounds=0
llama_steps=10
only=""
load_model=""
scale_models=""
scale_args=""
qlora_models=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out-dir) out_dir="$2"; shift ;;
    --batch) batch="$2"; shift ;;
    --steps) steps="$2"; shift ;;
    --pairs|--rounds) pairs="$2"; shift ;;
    --compile) compile=1 ;;
    --llama-rounds) llama_rounds="$2"; shift ;;
    --only) only="$2"; shift ;;
    --load) load_model="$2"; shift ;;
    --scale) scale_models="$2"; shift ;;
    --scale-args) scale_args="$2"; shift ;;
    --qlora) qlora_models="$2"; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
say "building bench_gpu_gpt_step bench_gpu_ops bench_load_pretrained bench_gpu_scale_step bench_gpu_qlora_step"
if ! cmake --build "$BUILD_DIR" -j "$(nproc)" --target bench_gpu_gpt_step bench_gpu_ops bench_load_pretrained \
    bench_gpu_scale_step bench_gpu_qlora_step \
    >>"$out_dir/build.log" 2>&1; then
  grep -m20 -E "error" "$out_dir/build.log" >&2 || tail -40 "$out_dir/build.log" >&2
  exit 1
fi
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# The reports, written however the run ends (a failed variant, a stopped
# run): whatever results it left.
write_reports() {
  # The step report needs the rounds' results (--rounds 0 leaves none).
  if compgen -G "$out_dir/*_1.json" >/dev/null; then
    "$PY" bench/gpu/report.py "$out_dir" || say "report.py failed"
  fi
  if [ -n "$scale_models" ] || [ -n "$load_model" ] || [ -n "$qlora_models" ]; then
    "$PY" bench/gpu/scale_report.py "$out_dir" || say "scale_report.py failed"
  fi
}
trap write_reports EXIT
trap 'exit 143' TERM INT

# ---- run: ours and PyTorch's, alternated ---------------------------------------------
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  >"$out_dir/nvidia-smi.csv" 2>/dev/null || true
common=(--device cuda --model gpt2-medium --batch "$batch" --steps "$steps" --warmup 3)
# name | program | its own options. Result files are <name>_<round>.json.
variants=(
  "ours|cpp|--optimizer adamw --loss logits"
  "ours_fused_adamw|cpp|--optimizer fused_adamw --loss logits"
  "ours_fused|cpp|--optimizer fused_adamw --loss fused"
  "ours_zero1_bf16_logits|cpp|--plugin zero1 --optimizer fused_adamw --loss logits"
  "ours_zero1_bf16|cpp|--plugin zero1 --optimizer fused_adamw --loss fused"
  "ours_zero1_bf16_recompute|cpp|--plugin zero1 --optimizer fused_adamw --loss fused --recompute-mlp on"
  "ours_zero1_bf16_graph|cpp|--plugin zero1 --optimizer fused_adamw --loss fused --cuda-graph on"
  "ours_fp16|cpp|--precision fp16 --optimizer fused_adamw --loss fused"
  "ours_zero1_fp16_graph|cpp|--precision fp16 --plugin zero1 --optimizer fused_adamw --loss fused --cuda-graph on"
  "torch|py|"
  "torch_fused|py|--fused"
  "torch_fused_fp16|py|--fused --fp16"
  "hf_ours_fused|cpp|--model gpt2-medium-hf --optimizer fused_adamw --loss fused"
  "hf_ours_zero1_bf16|cpp|--model gpt2-medium-hf --plugin zero1 --optimizer fused_adamw --loss fused"
  "hf_torch_fused|py|--model gpt2-medium-hf --fused"
  "ours_zero1_bf16_fp8|cpp|--plugin zero1 --optimizer fused_adamw --loss fused --use-fp8 on"
)
run_variant() { # name, program, options, round
  local name=$1 prog=$2 opts=$3 i=$4
  if [ -n "$only" ] && ! [[ $name =~ $only ]]; then return 0; fi
  say "round $i/$pairs: $name $opts"
  if [ "$prog" = cpp ]; then
    # shellcheck disable=SC2086
    "$BUILD_DIR/bench/bench_gpu_gpt_step" "${common[@]}" $opts --out "$out_dir/${name}_$i.json" \
      >"$out_dir/${name}_$i.log" 2>&1
  else
    # shellcheck disable=SC2086
    "$PY" bench/gpu/torch_gpt_step.py "${common[@]}" $opts --out "$out_dir/${name}_$i.json" \
      >"$out_dir/${name}_$i.log" 2>&1
  fi || { tail -20 "$out_dir/${name}_$i.log" >&2; return 1; }
  tail -1 "$out_dir/${name}_$i.log"
}
# Each fused op alone against its ATen composition, once (ops.json).
if [ -z "$only" ] || [[ ops =~ $only ]]; then
  say "fused ops alone"
  # Reported, not fatal: the step benchmarks below do not depend on it.
  if "$BUILD_DIR/bench/bench_gpu_ops" --device cuda --out "$out_dir/ops.json" >"$out_dir/ops.log" 2>&1; then
    cat "$out_dir/ops.log"
  else
    say "bench_gpu_ops failed (see ops.log); going on"
    tail -20 "$out_dir/ops.log" >&2
  fi
fi
# A variant that has not yet run on a GPU (the CUDA-graph ones, the MLP
# recomputed, one attention kernel alone, fp16) failing is reported and the
# rounds go on; any other failure ends the run.
untried_re='(_graph|_recompute|_sdpa_[a-z]+|_fp16|_fp8)$'
run_or_stop() { # name, then run_variant's arguments
  local name=$1
  shift
  run_variant "$name" "$@" && return 0
  if [[ $name =~ $untried_re ]]; then
    say "$name failed (not yet run on a GPU before); going on"
    return 0
  fi
  return 1
}
for i in $(seq 1 "$pairs"); do
  for v in "${variants[@]}"; do
    IFS='|' read -r name prog opts <<<"$v"
    run_or_stop "$name" "$name" "$prog" "$opts" "$i" || exit 1
  done
done
# Llama 3.2 1B's shape, batch 4 x 2048: ours against transformers'
# LlamaForCausalLM (SDPA) with fused AdamW, both bf16 autocast.
llama=(--model llama3.2-1b --batch 4 --steps "$llama_steps")
llama_variants=(
  "llama_ours|cpp|--optimizer adamw"
  "llama_ours_fused_adamw|cpp|--optimizer fused_adamw"
  "llama_ours_fused|cpp|--optimizer fused_adamw --loss fused"
  "llama_ours_fused_recompute|cpp|--optimizer fused_adamw --loss fused --recompute-mlp on"
  "llama_ours_fused_cast_each|cpp|--optimizer fused_adamw --loss fused --shared-casts off"
  "llama_ours_zero1_bf16|cpp|--plugin zero1 --optimizer fused_adamw --loss fused"
  "llama_ours_fused_graph|cpp|--optimizer fused_adamw --loss fused --cuda-graph on"
  "llama_ours_fused_sdpa_flash|cpp|--optimizer fused_adamw --loss fused --sdpa flash"
  "llama_ours_fused_sdpa_cudnn|cpp|--optimizer fused_adamw --loss fused --sdpa cudnn"
  "llama_torch_fused|py|--fused"
  "llama_ours_zero1_bf16_fp8|cpp|--plugin zero1 --optimizer fused_adamw --loss fused --use-fp8 on"
)
for i in $(seq 1 "$llama_rounds"); do
  for v in "${llama_variants[@]}"; do
    IFS='|' read -r name prog opts <<<"$v"
    run_or_stop "$name" "$name" "$prog" "${llama[*]} $opts" "$i" || exit 1
  done
done
# One profiled run of our main variants (bench_gpu_gpt_step --profile):
# the device's time per step by kernel kind, profile_<variant>.json. A
# failure here is reported and leaves the timings above.
profiles=(
  "ours_fused_adamw|${common[*]} --optimizer fused_adamw --loss logits"
  "ours_zero1_bf16|${common[*]} --plugin zero1 --optimizer fused_adamw --loss fused"
)
if [ "$llama_rounds" -gt 0 ]; then
  profiles+=("llama_ours_fused|${common[*]} ${llama[*]} --optimizer fused_adamw --loss fused")
fi
for v in "${profiles[@]}"; do
  IFS='|' read -r name opts <<<"$v"
  if [ -n "$only" ] && ! [[ profile_$name =~ $only ]]; then continue; fi
  say "profile: $name"
  # shellcheck disable=SC2086
  "$BUILD_DIR/bench/bench_gpu_gpt_step" $opts --steps 3 --split-steps 0 --profile 3 \
    --out "$out_dir/profile_$name.json" >"$out_dir/profile_$name.log" 2>&1 \
    || say "profile of $name failed (see profile_$name.log)"
done
if [ "$compile" = 1 ]; then
  # Once, after the rounds: compilation takes most of its run.
  run_variant torch_compile py "--fused --compile" 1 || exit 1
  if [ "$llama_rounds" -gt 0 ]; then
    run_variant llama_torch_compile py "${llama[*]} --fused --compile" 1 || exit 1
  fi
fi
if [ -n "$load_model" ]; then
  say "loading a $load_model directory against reading its files"
  "$BUILD_DIR/bench/bench_load_pretrained" --model "$load_model" --rounds 2 \
    --out "$out_dir/load.json" >"$out_dir/load.log" 2>&1 || { tail -20 "$out_dir/load.log" >&2; exit 1; }
  tail -1 "$out_dir/load.log"
fi
scale_variants=(
  "gemini_static|cpp|--setup gemini_static"
  "gemini_static_overlap|cpp|--setup gemini_static --overlap-host-step 1"
  "gemini_auto|cpp|--setup gemini_auto --gpu-margin-mem-ratio 0.8"
  "gemini_auto_overlap|cpp|--setup gemini_auto --gpu-margin-mem-ratio 0.8 --overlap-host-step 1"
  "zero2_offload|cpp|--setup zero2_offload"
  "zero2_offload_overlap|cpp|--setup zero2_offload --overlap-host-step 1"
  "zero2|cpp|--setup zero2"
  "fsdp2_offload|py|--mode fsdp2_offload"
)
for model in ${scale_models//,/ }; do
  for v in "${scale_variants[@]}"; do
    IFS='|' read -r setup prog opts <<<"$v"
    name=scale_${model}_$setup
    if [ -n "$only" ] && ! [[ $name =~ $only ]]; then continue; fi
    say "$name"
    # A bound on each run: a stuck host step must not take the whole run.
    if [ "$prog" = cpp ]; then
      # shellcheck disable=SC2086
      timeout 1200 "$BUILD_DIR/bench/bench_gpu_scale_step" --device cuda --model "$model" $opts $scale_args \
        --out "$out_dir/$name.json" >"$out_dir/$name.log" 2>&1
    else
      # shellcheck disable=SC2086
      timeout 1200 "$PY" bench/gpu/fsdp2_peer.py --device cuda --model "$model" $opts $scale_args \
        --out "$out_dir/$name.json" >"$out_dir/$name.log" 2>&1
    fi || say "$name failed (see $name.log)"
    tail -1 "$out_dir/$name.log"
  done
done
for model in ${qlora_models//,/ }; do
  for side in ours peer; do
    name=qlora_${model}_$side
    if [ -n "$only" ] && ! [[ $name =~ $only ]]; then continue; fi
    say "$name"
    if [ "$side" = ours ]; then
      timeout 900 "$BUILD_DIR/bench/bench_gpu_qlora_step" --device cuda --model "$model" \
        --out "$out_dir/$name.json" >"$out_dir/$name.log" 2>&1
    else
      timeout 900 "$PY" bench/gpu/qlora_peer.py --device cuda --model "$model" \
        --out "$out_dir/$name.json" >"$out_dir/$name.log" 2>&1
    fi || say "$name failed (see $name.log)"
    tail -1 "$out_dir/$name.log"
  done
done
say "report: $out_dir/report.md"
