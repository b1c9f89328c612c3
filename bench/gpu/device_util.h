#pragma once

// What the GPU benchmarks share: the dense bf16 matmul rate MFU is
// measured against (in the same run), and the device allocator's peak.

#include "../bench_util.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <string>

#ifdef COLOSSALAI_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

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

/// --device as given ("cuda" or "cpu"), or the GPU where there is one;
/// "cuda" without one is refused.
inline std::string resolve_device(const std::string& given) {
  const std::string device =
      given.empty() ? (torch::cuda::is_available() ? "cuda" : "cpu") : given;
  TORCH_CHECK(
      device == "cpu" || torch::cuda::is_available(),
      "--device cuda asked for, but CUDA is not available");
  return device;
}

/// The caching allocator's peak of allocated bytes on `dev` since the
/// start or the last reset (-1 off CUDA).
inline int64_t peak_device_bytes(const at::Device& dev) {
#ifdef COLOSSALAI_WITH_CUDA
  if (dev.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
        dev.has_index() ? dev.index() : 0);
    return stats.allocated_bytes[0].peak; // StatType::AGGREGATE
  }
#endif
  (void)dev;
  return -1;
}

inline void reset_peak_device_bytes(const at::Device& dev) {
#ifdef COLOSSALAI_WITH_CUDA
  if (dev.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(dev.has_index() ? dev.index() : 0);
  }
#endif
  (void)dev;
}

/// Elements of `ts` together.
inline int64_t numel(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    n += t.numel();
  }
  return n;
}

} // namespace bench
} // namespace colossalai
