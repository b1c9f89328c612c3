#pragma once

// A 4-bit weight's per-block scale on the device (BlockScales), for the
// dequantizer and the few-row products.

#include "dequantize_4bit_cuda.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

// As quantization::dequantize_4bit's reference forms a block's absmax: no
// contraction of the nested value's product and sum into one rounding.
__device__ __forceinline__ float block_scale(const BlockScales& s, int64_t b) {
  if (s.nested_absmax == nullptr) {
    return s.absmax[b];
  }
  const int64_t b2 = s.shift2 >= 0 ? b >> s.shift2 : b / s.blocksize2;
  return __fadd_rn(
      __fmul_rn(s.code2[s.nested_absmax[b]], s.absmax2[b2]), *s.offset);
}

// The 16 code values into the block's shared `table` (every thread waits).
__device__ __forceinline__ void load_code_table(
    float* table,
    const float* code) {
  if (threadIdx.x < 16) {
    table[threadIdx.x] = code[threadIdx.x];
  }
  __syncthreads();
}

// Which block flat index i is in: a shift where blocksize is 2^shift.
__device__ __forceinline__ int64_t
block_of(int64_t i, int64_t blocksize, int shift) {
  return shift >= 0 ? i >> shift : i / blocksize;
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
