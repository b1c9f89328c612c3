#pragma once

// The local arithmetic of reducing collectives (internal): one place for
// every path that sums, averages or takes extremes of received pieces.

#include <colossalai/distributed/collectives.h>

#include <ATen/ATen.h>

#include <vector>

namespace colossalai {
namespace distributed {
namespace detail {

/// dst = srcs[0] (op) srcs[1] (op) ..., in that order, so every caller that
/// gives the same pieces gets the same bits. `dst` may be any of `srcs`.
/// 16-bit sums and averages accumulate in fp32 and round once, in
/// `*fp32_scratch` when given (grown as needed), else in a fresh buffer.
void reduce_into(
    at::Tensor dst,
    const std::vector<at::Tensor>& srcs,
    ReduceOp op,
    at::Tensor* fp32_scratch = nullptr);

} // namespace detail
} // namespace distributed
} // namespace colossalai
