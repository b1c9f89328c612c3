// libFuzzer target for the safetensors header parser (build and run with
// fuzz/run.sh). Any input must either be rejected with c10::Error or yield a
// header whose tensors tile the data section inside the input; each accepted
// tensor is then viewed over the input and summed, so the sanitizers see
// every byte it claims.

#include <colossalai/checkpoint_io/safetensors.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace st = colossalai::checkpoint_io::safetensors;

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  at::set_num_threads(1);
  // LibTorch initialises lazily on first use; do it before the leak checker
  // starts watching single inputs.
  at::ones({2}).sum().item<double>();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  st::Header header;
  try {
    header = st::parse_header(data, size, "fuzz input");
  } catch (const c10::Error&) {
    return 0;
  }
  // The parser's promises, checked rather than trusted.
  if (header.data_offset < 8 ||
      static_cast<size_t>(header.data_offset) > size) {
    __builtin_trap();
  }
  int64_t cursor = 0;
  for (const st::TensorInfo& info : header.tensors) {
    int64_t numel = 1;
    for (int64_t d : info.shape) {
      numel *= d;
    }
    if (info.begin != cursor ||
        info.end - info.begin !=
            numel * static_cast<int64_t>(c10::elementSize(info.dtype))) {
      __builtin_trap();
    }
    cursor = info.end;
  }
  if (header.data_offset + cursor != static_cast<int64_t>(size)) {
    __builtin_trap();
  }

  double total = 0;
  for (const st::TensorInfo& info : header.tensors) {
    auto* p = const_cast<uint8_t*>(data) + header.data_offset + info.begin;
    const int64_t nbytes = info.end - info.begin;
    total += at::from_blob(p, {nbytes}, at::kByte).sum().item<double>();
    if (nbytes == 0 || info.dtype == at::kBool) {
      continue; // bool bytes other than 0 and 1 are not valid bools
    }
    const auto options = at::TensorOptions().dtype(info.dtype);
    at::Tensor t;
    if (reinterpret_cast<uintptr_t>(p) % c10::elementSize(info.dtype) != 0) {
      // As MappedFile::tensor does for unpadded headers.
      t = at::empty(info.shape, options);
      std::memcpy(t.data_ptr(), p, static_cast<size_t>(nbytes));
    } else {
      t = at::from_blob(p, info.shape, options);
    }
    total += t.sum(at::kDouble).item<double>();
  }
  volatile double sink = total;
  (void)sink;
  return 0;
}
