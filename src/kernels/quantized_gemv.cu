// Few-row products on quantized weights (NOTE [Few-row products on
// quantized weights]): a warp computes four output features, reading their
// packed weight rows once and every row of x beside them, so the weight's
// bytes cross the memory bus once, 4 bits (or 8) per value, with no
// dequantized copy written and read back.

#include "quantized_gemv_cuda.h"

#include "block_scales.cuh"
#include "cuda_device.cuh"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kFeatures = 4; // output features per warp: x read once for 4
constexpr int kRows = static_cast<int>(kGemvMaxRows);

template <class T>
__device__ __forceinline__ float weight(
    const float* table,
    int nibble,
    float scale) {
  return round_to<T>(__fmul_rn(table[nibble], scale));
}

// The output features a warp computes: f0 .. f0 + count - 1 (count 0:
// none left for it).
struct WarpFeatures {
  int64_t f0;
  int count;
};

__device__ __forceinline__ WarpFeatures warp_features(int64_t n) {
  const int64_t f0 =
      (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) *
      kFeatures;
  const int64_t left = n - f0;
  return {
      f0,
      left <= 0 ? 0 : (left < kFeatures ? static_cast<int>(left) : kFeatures)};
}

// Sums each lane's partial sums over the warp; lane 0 writes them,
// converted by `cvt`, to out [m, n].
template <class A, class O, class Convert>
__device__ __forceinline__ void store_warp_sums(
    A (&acc)[kFeatures][kRows],
    int m,
    WarpFeatures w,
    int64_t n,
    O* out,
    Convert cvt) {
#pragma unroll
  for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < m && f < w.count) {
        A v = acc[f][r];
        for (int o = 16; o > 0; o >>= 1) {
          v += __shfl_xor_sync(0xffffffffu, v, o);
        }
        if (threadIdx.x % 32 == 0) {
          out[r * n + w.f0 + f] = cvt(v);
        }
      }
    }
  }
}

// x times the warp's features of the 4-bit weight (warp_features). kPacked:
// k and blocksize multiples of 32 and the bytes 16-byte aligned, so a
// lane's 16 bytes of a row are 32 values of one block.
template <class T, bool kPacked>
__global__ void __launch_bounds__(kThreads) gemv_4bit_kernel(
    const T* __restrict__ x,
    int m,
    int64_t k,
    const uint8_t* __restrict__ packed,
    BlockScales scales,
    const float* __restrict__ code,
    int64_t blocksize,
    int shift,
    int64_t n,
    T* __restrict__ out) {
  __shared__ float table[16];
  load_code_table(table, code);
  const int lane = threadIdx.x % 32;
  const WarpFeatures wf = warp_features(n);
  if (wf.count == 0) {
    return;
  }
  const int64_t f0 = wf.f0;
  const int features = wf.count;
  float acc[kFeatures][kRows] = {};
  if (kPacked) {
    for (int64_t p = lane; p < k / 32; p += 32) {
      const int64_t col = p * 32;
      uint4 words[kFeatures];
      float scale[kFeatures];
#pragma unroll
      for (int f = 0; f < kFeatures; ++f) {
        if (f < features) {
          const int64_t first = (f0 + f) * k + col; // flat index, even
          words[f] = *reinterpret_cast<const uint4*>(packed + first / 2);
          scale[f] = block_scale(scales, block_of(first, blocksize, shift));
        }
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t c = col + q * 8 + j * 2;
          float xa[kRows], xb[kRows];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r < m) {
              xa[r] = to_float(x[r * k + c]);
              xb[r] = to_float(x[r * k + c + 1]);
            }
          }
#pragma unroll
          for (int f = 0; f < kFeatures; ++f) {
            if (f < features) {
              const uint32_t word = q == 0 ? words[f].x
                  : q == 1                 ? words[f].y
                  : q == 2                 ? words[f].z
                                           : words[f].w;
              // Memory order is little-endian: byte j of the word.
              const uint32_t byte = (word >> (8 * j)) & 255u;
              const float hi = weight<T>(table, byte >> 4, scale[f]);
              const float lo = weight<T>(table, byte & 15, scale[f]);
#pragma unroll
              for (int r = 0; r < kRows; ++r) {
                if (r < m) {
                  acc[f][r] += hi * xa[r];
                  acc[f][r] += lo * xb[r];
                }
              }
            }
          }
        }
      }
    }
  } else {
    for (int64_t c = lane; c < k; c += 32) {
      float xs[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < m) {
          xs[r] = to_float(x[r * k + c]);
        }
      }
#pragma unroll
      for (int f = 0; f < kFeatures; ++f) {
        if (f < features) {
          const int64_t i = (f0 + f) * k + c;
          const uint8_t byte = packed[i / 2];
          const int nibble = i % 2 == 0 ? byte >> 4 : byte & 15;
          const float w = weight<T>(
              table,
              nibble,
              block_scale(scales, block_of(i, blocksize, shift)));
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r < m) {
              acc[f][r] += w * xs[r];
            }
          }
        }
      }
    }
  }
  store_warp_sums(acc, m, wf, n, out, [](float v) { return from_float<T>(v); });
}

// kPacked: k a multiple of 16 and a, b 16-byte aligned (every row too).
template <bool kPacked>
__global__ void __launch_bounds__(kThreads) int8_gemv_kernel(
    const int8_t* __restrict__ a,
    int m,
    int64_t k,
    const int8_t* __restrict__ b,
    int64_t n,
    int32_t* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const WarpFeatures wf = warp_features(n);
  if (wf.count == 0) {
    return;
  }
  const int64_t f0 = wf.f0;
  const int features = wf.count;
  int32_t acc[kFeatures][kRows] = {};
  if (kPacked) {
    for (int64_t p = lane; p < k / 16; p += 32) {
      int4 xs[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < m) {
          xs[r] = *reinterpret_cast<const int4*>(a + r * k + p * 16);
        }
      }
#pragma unroll
      for (int f = 0; f < kFeatures; ++f) {
        if (f < features) {
          const int4 w =
              *reinterpret_cast<const int4*>(b + (f0 + f) * k + p * 16);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r < m) {
              int32_t s = acc[f][r];
              s = __dp4a(w.x, xs[r].x, s);
              s = __dp4a(w.y, xs[r].y, s);
              s = __dp4a(w.z, xs[r].z, s);
              s = __dp4a(w.w, xs[r].w, s);
              acc[f][r] = s;
            }
          }
        }
      }
    }
  } else {
    for (int64_t c = lane; c < k; c += 32) {
#pragma unroll
      for (int f = 0; f < kFeatures; ++f) {
        if (f < features) {
          const int32_t w = b[(f0 + f) * k + c];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r < m) {
              acc[f][r] += w * static_cast<int32_t>(a[r * k + c]);
            }
          }
        }
      }
    }
  }
  store_warp_sums(acc, m, wf, n, out, [](int32_t v) { return v; });
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

unsigned grid_for(int64_t n) {
  const int64_t per_block = static_cast<int64_t>(kWarps) * kFeatures;
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

} // namespace

cudaError_t gemv_4bit(
    Dtype dtype,
    const void* x,
    int64_t m,
    int64_t k,
    const uint8_t* packed,
    const BlockScales& scales,
    const float* code,
    int64_t blocksize,
    int blocksize_shift,
    int64_t n,
    void* out,
    cudaStream_t stream) {
  if (m < 1 || m > kGemvMaxRows) {
    return cudaErrorInvalidValue;
  }
  const bool vectorised =
      k % 32 == 0 && blocksize % 32 == 0 && aligned16(packed);
  return launch_by_dtype(dtype, m * n, [&](auto t) {
    using T = decltype(t);
    const auto* xs = static_cast<const T*>(x);
    auto* ys = static_cast<T*>(out);
    const int rows = static_cast<int>(m);
    if (vectorised) {
      gemv_4bit_kernel<T, true><<<grid_for(n), kThreads, 0, stream>>>(
          xs, rows, k, packed, scales, code, blocksize, blocksize_shift, n, ys);
    } else {
      gemv_4bit_kernel<T, false><<<grid_for(n), kThreads, 0, stream>>>(
          xs, rows, k, packed, scales, code, blocksize, blocksize_shift, n, ys);
    }
  });
}

cudaError_t int8_gemv(
    const int8_t* a,
    int64_t m,
    int64_t k,
    const int8_t* b,
    int64_t n,
    int32_t* out,
    cudaStream_t stream) {
  if (m < 1 || m > kGemvMaxRows) {
    return cudaErrorInvalidValue;
  }
  if (m * n == 0) {
    return cudaSuccess;
  }
  const int rows = static_cast<int>(m);
  if (k % 16 == 0 && aligned16(a) && aligned16(b)) {
    int8_gemv_kernel<true>
        <<<grid_for(n), kThreads, 0, stream>>>(a, rows, k, b, n, out);
  } else {
    int8_gemv_kernel<false>
        <<<grid_for(n), kThreads, 0, stream>>>(a, rows, k, b, n, out);
  }
  return cudaGetLastError();
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
