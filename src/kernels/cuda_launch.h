#pragma once

// The host side of a kernel launch, shared by the kernels' `.cpp` files
// (built with CUDA kernels only): ATen's dtype as the launchers' Dtype, and
// a launch's error as a c10::Error naming the op.

#include "cuda_types.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace colossalai {
namespace kernels {
namespace cuda {

inline Dtype dtype_of(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat:
      return Dtype::kFloat;
    case at::kHalf:
      return Dtype::kHalf;
    default:
      TORCH_INTERNAL_ASSERT(t == at::kBFloat16, op, ": no kernel for ", t);
      return Dtype::kBFloat16;
  }
}

inline void check_launch(cudaError_t e, const char* op, const char* what) {
  TORCH_CHECK(e == cudaSuccess, op, ": ", what, " failed: ", cudaGetErrorString(e));
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
