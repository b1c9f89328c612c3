#pragma once

// What the kernels' launch headers (`<op>_cuda.h`) share: plain C++ that
// nvcc and the host compiler both read (NOTE [Kernels]).

#include <cuda_runtime_api.h>

namespace colossalai {
namespace kernels {
namespace cuda {

/// The element types the kernels are built for.
enum class Dtype { kFloat, kHalf, kBFloat16 };

} // namespace cuda
} // namespace kernels
} // namespace colossalai
