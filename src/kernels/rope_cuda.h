#pragma once

// rope's CUDA launcher (rope.cu), over plain pointers (NOTE [Kernels]).

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// out = x * cos + rotate_half(x) * sin (or, with `inverse`, the inverse
/// rotation: x * cos - rotate_half^T(x * sin), the backward of the former)
/// over x [B, T, H, D] contiguous; cos and sin [T, D] (`tables_per_batch`
/// false) or [B, T, D], contiguous, in x's dtype.
cudaError_t rope(
    Dtype dtype,
    const void* x,
    const void* cos,
    const void* sin,
    void* out,
    int64_t batch,
    int64_t seq,
    int64_t heads,
    int64_t dim,
    bool tables_per_batch,
    bool inverse,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
