#pragma once

// use_fp8's cast to FP8 on a GPU (fp8_cast.cu), over plain pointers (NOTE
// [Kernels]): quantization/fp8_linear.cpp launches it. Returns the launch's
// error.

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// out[i] = fp8(x[i] * (largest / *amax)) over n contiguous elements, the
/// product in float32 and rounded to the nearest even FP8 value, as ATen's
/// (x * scale).to(float8) computes it; `e4m3`: float8_e4m3fn (largest
/// 448), else float8_e5m2 (57344). `amax`: one float32 on the device, > 0.
cudaError_t scale_cast_fp8(
    Dtype dtype,
    const void* x,
    const float* amax,
    uint8_t* out,
    int64_t n,
    bool e4m3,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
