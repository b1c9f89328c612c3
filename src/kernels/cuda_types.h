#pragma once

// What the kernels' launch headers (`<op>_cuda.h`) share: plain C++ that
// nvcc and the host compiler both read (NOTE [Kernels]).

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// The element types the kernels are built for.
enum class Dtype { kFloat, kHalf, kBFloat16 };

/// Row blocks a norm's weight (and bias) gradient is summed in over `rows`
/// rows: the float32 scratch holds that many partial sums per column.
inline int64_t norm_param_chunks(int64_t rows) {
  const int64_t chunks = (rows + 63) / 64;
  return chunks < 1 ? 1 : (chunks > 128 ? 128 : chunks);
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
