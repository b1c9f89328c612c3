#include "local_reduce.h"

namespace colossalai {
namespace distributed {
namespace detail {

void reduce_into(
    at::Tensor dst,
    const std::vector<at::Tensor>& srcs,
    ReduceOp op,
    at::Tensor* fp32_scratch) {
  const int n = static_cast<int>(srcs.size());
  TORCH_INTERNAL_ASSERT(n >= 1);
  if (dst.numel() == 0) {
    return; // empty shards (more ranks than elements)
  }
  if (n == 1) {
    if (!dst.is_same(srcs[0])) {
      dst.copy_(srcs[0]);
    }
    return;
  }
  const auto dtype = dst.scalar_type();
  const bool low = dtype == at::kBFloat16 || dtype == at::kHalf;
  if (low && (op == ReduceOp::kSum || op == ReduceOp::kAvg)) {
    at::Tensor acc;
    if (fp32_scratch != nullptr) {
      if (!fp32_scratch->defined() || fp32_scratch->numel() < dst.numel()) {
        *fp32_scratch = at::empty({dst.numel()}, at::kFloat);
      }
      acc = fp32_scratch->narrow(0, 0, dst.numel());
    } else {
      acc = at::empty({dst.numel()}, at::kFloat);
    }
    acc.copy_(srcs[0].view({-1}));
    for (int q = 1; q < n; ++q) {
      acc.add_(srcs[q].view({-1}));
    }
    if (op == ReduceOp::kAvg) {
      acc.div_(n);
    }
    dst.view({-1}).copy_(acc);
    return;
  }
  for (int q = 2; q < n; ++q) {
    if (srcs[q].data_ptr() == dst.data_ptr()) {
      // The first step would overwrite an operand still to come (a
      // reduce-scatter into this rank's own piece of its input).
      auto tmp = at::empty_like(dst);
      reduce_into(tmp, srcs, op, fp32_scratch);
      dst.copy_(tmp);
      return;
    }
  }
  // Two-operand kernels into `dst`: a reduction over a stacked dimension
  // into a fresh tensor (an allocation, its page faults, a strided kernel)
  // costs 10-20x as much.
  switch (op) {
    case ReduceOp::kMax:
      at::maximum_out(dst, srcs[0], srcs[1]);
      for (int q = 2; q < n; ++q) {
        at::maximum_out(dst, dst, srcs[q]);
      }
      break;
    case ReduceOp::kMin:
      at::minimum_out(dst, srcs[0], srcs[1]);
      for (int q = 2; q < n; ++q) {
        at::minimum_out(dst, dst, srcs[q]);
      }
      break;
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      at::add_out(dst, srcs[0], srcs[1]);
      for (int q = 2; q < n; ++q) {
        dst.add_(srcs[q]);
      }
      if (op == ReduceOp::kAvg) {
        dst.div_(n);
      }
      break;
  }
}

} // namespace detail
} // namespace distributed
} // namespace colossalai
