#pragma once

// A 4-bit state's per-block scales where the dequantizer and the few-row
// products read them: the fp32 absmax, or with double quantization the
// uint8 codes decoded on the way (no fp32 copy of every block's absmax made
// per call, as block_absmax's ATen composition does).

#include <colossalai/quantization/bnb.h>

#include <ATen/core/Tensor.h>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "../kernels/dequantize_4bit_cuda.h"
#endif

#include <cstdint>

namespace colossalai {
namespace quantization {
namespace detail {

/// On the CPU, as block_absmax forms them: a nested scale is
/// fl(fl(code2[q] * absmax2) + offset). The product of two floats is exact
/// in double, so rounding it to float is the fp32 product whatever the
/// compiler contracts.
struct CpuScales {
  const float* absmax = nullptr;
  const uint8_t* nested = nullptr;
  const float* code2 = nullptr;
  const float* absmax2 = nullptr;
  float offset = 0.f;
  int64_t blocksize2 = 256;

  float operator()(int64_t b) const {
    if (nested == nullptr) {
      return absmax[b];
    }
    const auto p = static_cast<float>(
        static_cast<double>(code2[nested[b]]) * absmax2[b / blocksize2]);
    return p + offset;
  }
};

/// The state's scale tensors for `blocks` blocks on `device`, checked: a
/// state too short for them, or a nested one missing a part, is refused as
/// corrupt, naming `op`.
struct ScaleTensors {
  ScaleTensors(
      const QuantState4bit& st,
      int64_t blocks,
      const at::Device& device,
      const char* op);

  /// Pointers into the CPU tensors (reads the offset).
  CpuScales cpu() const;
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  /// Pointers into the device tensors (the offset stays there).
  kernels::cuda::BlockScales cuda() const;
#endif

  at::Tensor absmax; ///< fp32 per block (not nested)
  at::Tensor nested; ///< uint8 per block
  at::Tensor code2, absmax2, offset;
  int64_t blocksize2 = 256;
};

} // namespace detail
} // namespace quantization
} // namespace colossalai
