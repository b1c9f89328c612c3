#!/usr/bin/env bash
# Builds a fuzzer with libFuzzer, ASan and UBSan, then runs it on a copy of
# its seed corpus.
#
#   fuzz/run.sh [TARGET] [SECONDS] [-- LIBFUZZER_FLAGS...]
#
# TARGET: safetensors (the header parser, default), zip (the zip directory
# reader of .bin checkpoints), tokenizer (the SentencePiece tokenizer.model
# reader and the NFC normalizer), tokenizer_json (tokenizer.json and
# tokenizer_config.json), pickle (the hardened unpickler and the
# optimizer-state path), adapter_config (LoRA's adapter_config.json and
# target_modules matching) or config (every family's config.json reader);
# the last three link the library built in $COLOSSALAI_LIB, default
# build/libcolossalai.a, for what they do not compile instrumented, config
# also $COLOSSALAI_MODELS_LIB, default build/libcolossalai_models.a.
# SECONDS: default 20. Needs clang and libFuzzer
# (Debian: clang, libclang-rt-N-dev) and LibTorch: under /usr, or where
# TORCH_INCLUDE / TORCH_LIBDIR say. The binary and
# any crash inputs go to $FUZZ_BUILD_DIR (default build/fuzz). Exits non-zero
# when the fuzzer finds a crash.
set -euo pipefail

target=safetensors
if [[ $# -gt 0 && ! "$1" =~ ^[0-9]+$ && "$1" != "--" ]]; then
  target="$1"
  shift
fi
seconds=20
if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then
  seconds="$1"
  shift
fi
[[ $# -gt 0 && "$1" == "--" ]] && shift
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${FUZZ_BUILD_DIR:-$repo/build/fuzz}"
cxx="${FUZZ_CXX:-clang++}"
torch_include="${TORCH_INCLUDE:-/usr/include}"
# LibTorch's library folder (empty: the system's), the C++ standard its
# headers need and extra link flags; ctest passes those of its build.
torch_libdir="${TORCH_LIBDIR:-}"
std="${FUZZ_STD:-c++17}"
read -r -a link_flags <<<"${FUZZ_LINK_FLAGS:-}"
if [[ -n "$torch_libdir" ]]; then
  link_flags+=(-L"$torch_libdir" -Wl,-rpath,"$torch_libdir")
fi
mkdir -p "$out"

extra_link=()
includes=()
# The tokenizer's sources (no LibTorch), for both tokenizer targets.
tokenizer_sources=("$repo/src/models/tokenizer.cpp" "$repo/src/models/tokenizer_files.cpp"
  "$repo/src/models/tokenizer_json.cpp" "$repo/src/models/tokenizer_literals.cpp"
  "$repo/src/models/tokenizer_sentencepiece.cpp" "$repo/src/models/tokenizer_sentencepiece_pipeline.cpp"
  "$repo/src/models/tokenizer_sentencepiece_encode.cpp" "$repo/src/models/tokenizer_save.cpp"
  "$repo/src/models/tokenizer_unicode.cpp" "$repo/src/models/tokenizer_pretokenize.cpp"
  "$repo/src/models/unicode_nfc.cpp" "$repo/src/utils/bounded_read.cpp")
tokenizer_headers=("$repo/include/colossalai/models/tokenizer.h" "$repo/src/models/tokenizer_internal.h"
  "$repo/src/models/tokenizer_literals.h" "$repo/src/models/unicode_nfc_tables.h"
  "$repo/src/utils/bounded_read.h")
case "$target" in
  safetensors)
    sources=("$repo/fuzz/safetensors_fuzz.cpp" "$repo/src/checkpoint_io/safetensors.cpp" "$repo/src/checkpoint_io/mapped_reads.cpp")
    headers=("$repo/include/colossalai/checkpoint_io/safetensors.h" "$repo/src/checkpoint_io/safetensors_internal.h")
    flags=(-max_len=4096 -dict="$repo/fuzz/safetensors.dict")
    ;;
  zip)
    sources=("$repo/fuzz/zip_fuzz.cpp" "$repo/src/checkpoint_io/zip_records.cpp"
             "$repo/src/checkpoint_io/mapped_reads.cpp")
    headers=("$repo/src/checkpoint_io/zip_records.h" "$repo/include/colossalai/checkpoint_io/mapped_reads.h")
    flags=(-max_len=8192)
    ;;
  tokenizer)
    sources=("$repo/fuzz/tokenizer_fuzz.cpp" "${tokenizer_sources[@]}")
    headers=("${tokenizer_headers[@]}")
    flags=(-max_len=8192)
    ;;
  tokenizer_json)
    sources=("$repo/fuzz/tokenizer_json_fuzz.cpp" "${tokenizer_sources[@]}")
    headers=("${tokenizer_headers[@]}")
    flags=(-max_len=16384 -dict="$repo/fuzz/tokenizer_json.dict")
    ;;
  adapter_config)
    sources=("$repo/fuzz/adapter_config_fuzz.cpp" "$repo/src/lora/lora_config.cpp"
             "$repo/src/lora/lora_model.cpp" "$repo/src/lora/lora_model_plan.cpp"
             "$repo/src/lora/lora_model_io.cpp" "$repo/src/lora/module_regex.cpp"
             "$repo/src/lora/module_regex_parse.cpp" "$repo/src/lora/module_regex_atoms.cpp"
             "$repo/src/lora/module_regex_compile.cpp" "$repo/src/utils/bounded_read.cpp")
    headers=("$repo/include/colossalai/lora/lora_config.h" "$repo/include/colossalai/lora/lora_model.h"
             "$repo/src/lora/lora_model_internal.h" "$repo/src/lora/module_regex.h"
             "$repo/src/lora/module_regex_internal.h" "$repo/src/utils/bounded_read.h")
    lib="${COLOSSALAI_LIB:-$repo/build/libcolossalai.a}"
    [[ -f "$lib" ]] || { echo "fuzz/run.sh adapter_config: build the library first ($lib)" >&2; exit 2; }
    extra_link=("$lib" -lgomp -lpthread -lz)
    headers+=("$lib")
    flags=(-max_len=8192 -dict="$repo/fuzz/adapter_config.dict")
    ;;
  pickle)
    sources=("$repo/fuzz/pickle_fuzz.cpp" "$repo/src/checkpoint_io/torch_bin.cpp"
             "$repo/src/checkpoint_io/torch_bin_unpickler.cpp"
             "$repo/src/checkpoint_io/torch_bin_rebuild.cpp"
             "$repo/src/checkpoint_io/optimizer_state.cpp")
    headers=("$repo/src/checkpoint_io/pickle_reader.h" "$repo/src/checkpoint_io/torch_bin_unpickler.h"
             "$repo/include/colossalai/checkpoint_io/optimizer_state.h")
    lib="${COLOSSALAI_LIB:-$repo/build/libcolossalai.a}"
    [[ -f "$lib" ]] || { echo "fuzz/run.sh pickle: build the library first ($lib)" >&2; exit 2; }
    extra_link=("$lib" -lgomp -lpthread -lz)
    headers+=("$lib")
    flags=(-max_len=8192 -dict="$repo/fuzz/pickle.dict")
    ;;
  config)
    sources=("$repo/fuzz/config_fuzz.cpp" "$repo/src/models/config_fields.cpp"
             "$repo/src/models/pretrained_families.cpp" "$repo/src/models/pretrained_opt.cpp"
             "$repo/src/models/pretrained_bloom.cpp" "$repo/src/models/pretrained_bert.cpp")
    headers=("$repo/src/models/config_fields.h" "$repo/src/models/pretrained_internal.h"
             "$repo/src/utils/bounded_json.h")
    lib="${COLOSSALAI_LIB:-$repo/build/libcolossalai.a}"
    models_lib="${COLOSSALAI_MODELS_LIB:-$repo/build/libcolossalai_models.a}"
    for l in "$models_lib" "$lib"; do
      [[ -f "$l" ]] || { echo "fuzz/run.sh config: build the libraries first ($l)" >&2; exit 2; }
    done
    extra_link=("$models_lib" "$lib" -lz -lgomp -lpthread)
    headers+=("$models_lib" "$lib")
    includes=(-I"$repo/src")
    flags=(-max_len=4096)
    ;;
  *)
    echo "fuzz/run.sh: unknown target '$target' (safetensors, zip, tokenizer, tokenizer_json, pickle, adapter_config, config)" >&2
    exit 2
    ;;
esac
# The libraries are built in unity batches: an archive member pulled in for
# another symbol also defines the functions compiled here instrumented. The
# instrumented copies come first on the command line, and the first
# definition is the one linked.
if [[ ${#extra_link[@]} -gt 0 ]]; then
  extra_link+=(-Wl,--allow-multiple-definition)
fi
binary="$out/${target}_fuzz"
compile=("$cxx" -std="$std" -O1 -g -fno-omit-frame-pointer
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
  -I"$repo/include" "${includes[@]}" -I"$torch_include" -I"$torch_include/torch/csrc/api/include"
  "${sources[@]}" -o "$binary"
  "${extra_link[@]}" "${link_flags[@]}" -ltorch -ltorch_cpu -lc10)
rebuild=0
# Built again when a source changed or the command did (another LibTorch).
if [[ ! -x "$binary" || "$(cat "$binary.cmd" 2>/dev/null)" != "${compile[*]}" ]]; then
  rebuild=1
else
  for f in "${sources[@]}" "${headers[@]}"; do
    [[ "$f" -nt "$binary" ]] && rebuild=1
  done
fi
if (( rebuild )); then
  echo "building $binary"
  start=$(date +%s)
  "${compile[@]}"
  printf '%s' "${compile[*]}" >"$binary.cmd"
  echo "built in $(( $(date +%s) - start )) s"
fi

corpus="$(mktemp -d)"
trap 'rm -rf "$corpus"' EXIT
cp "$repo"/fuzz/corpus/"$target"/* "$corpus"/

"$binary" -max_total_time="$seconds" -timeout=10 "${flags[@]}" \
  -artifact_prefix="$out/${target}-" "$@" "$corpus"
