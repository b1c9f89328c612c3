#pragma once

// A 4-bit state's per-block scales where the dequantizer and the few-row
// products read them: the fp32 absmax, or with double quantization the
// uint8 codes decoded on the way (no fp32 copy of every block's absmax made
// per call, as block_absmax's ATen composition does).

#include <colossalai/quantization/bnb.h>

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "../kernels/dequantize_4bit_cuda.h"
#endif

#include <cstdint>
#include <cstring>

namespace colossalai {
namespace quantization {
namespace detail {

/// ceil(a / b) for a >= 0, b > 0, without a + b - 1 (which a corrupt
/// state's block size could overflow).
inline int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0 ? 1 : 0);
}

/// log2(v) where v is a power of two below 2^62, else -1 (a shift then
/// replaces the divide by a nested block size).
inline int exact_log2(int64_t v) {
  for (int s = 0; s < 62; ++s) {
    if ((int64_t(1) << s) == v) {
      return s;
    }
  }
  return -1;
}

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
  int shift2 = -1; ///< log2(blocksize2) where it is a power of two

  float operator()(int64_t b) const {
    if (nested == nullptr) {
      return absmax[b];
    }
    // A shift for bitsandbytes' 256: a 64-bit divide per block would cost
    // about as much as decoding the block.
    const int64_t b2 = shift2 >= 0 ? b >> shift2 : b / blocksize2;
    const auto p =
        static_cast<float>(static_cast<double>(code2[nested[b]]) * absmax2[b2]);
    return p + offset;
  }
};

/// A block's 16 values, code[c] * scale rounded to T, as fp32 (each exactly
/// what static_cast<T> of the fp32 product gives).
template <typename T>
inline void block_table(const float* code, float scale, float* table) {
  for (int c = 0; c < 16; ++c) {
    table[c] = static_cast<float>(static_cast<T>(code[c] * scale));
  }
}

/// bf16: c10::BFloat16's rounding (to nearest even, NaN to 0x7FC0) on the
/// bits, without its branch, so that the 16 roundings vectorise (with
/// c10's branch a block's table costs about as much as decoding it).
template <>
inline void block_table<c10::BFloat16>(
    const float* code,
    float scale,
    float* table) {
  float v[16];
  for (int c = 0; c < 16; ++c) {
    v[c] = code[c] * scale;
  }
  int32_t u[16];
  std::memcpy(u, v, sizeof(u));
  for (int c = 0; c < 16; ++c) {
    const auto bits = static_cast<uint32_t>(u[c]);
    const auto r = static_cast<int32_t>(
        (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
    // Signed compares of non-negative values (SSE2 has no unsigned one).
    u[c] = (u[c] & 0x7FFFFFFF) > 0x7F800000 ? 0x7FC00000 : r;
  }
  std::memcpy(table, u, sizeof(u));
}

/// A value of T's precision, as T (no rounding left to do).
template <typename T>
inline T exact_cast(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 exact_cast<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return c10::BFloat16(
      static_cast<uint16_t>(u >> 16), c10::BFloat16::from_bits());
}

/// Refuses, naming `op`, a state too short for `blocks` blocks or a nested
/// one missing a part (no tensor is copied).
void check_scales(const QuantState4bit& st, int64_t blocks, const char* op);

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
