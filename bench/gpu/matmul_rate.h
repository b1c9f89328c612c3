#pragma once

// The dense bf16 matmul rate MFU is measured against, in the same run.

#include "../bench_util.h"

#include <torch/torch.h>

#include <chrono>
#include <vector>

namespace colossalai {
namespace bench {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// FLOP/s of 5 timed blocks of n x n x n bf16 matmuls on `dev` (after
/// three warm-up products): the ceiling MFU is measured against.
inline std::vector<double> matmul_rates(const at::Device& dev, int64_t n) {
  auto opts = at::TensorOptions().dtype(at::kBFloat16).device(dev);
  auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
  auto c = torch::empty({n, n}, opts);
  const int iters = dev.is_cuda() ? 20 : 2;
  for (int i = 0; i < 3; ++i)
    at::matmul_out(c, a, b);
  sync(dev);
  std::vector<double> rates;
  for (int r = 0; r < 5; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i)
      at::matmul_out(c, a, b);
    sync(dev);
    rates.push_back(2.0 * n * n * n * iters / seconds_since(t0));
  }
  return rates;
}

} // namespace bench
} // namespace colossalai
