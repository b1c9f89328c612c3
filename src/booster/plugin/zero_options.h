#pragma once

// The ZeRO-1/2 optimizer options of a plugin whose options carry
// ColossalAI's ZeRO fields (internal; LowLevelZero and HybridParallel).

#include <colossalai/zero/low_level_optimizer.h>

#include "plugin_options.h"

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

/// `o` has overlap_communication, max_norm, the loss-scaler fields,
/// cpu_offload and communication_dtype; `bucket_size_in_m` is in units of
/// 2^20 elements.
template <class PluginOptions>
zero::LowLevelZeroOptimizerOptions zero_optimizer_options(
    const PluginOptions& o,
    int stage,
    at::ScalarType dtype,
    double bucket_size_in_m,
    const char* plugin) {
  zero::LowLevelZeroOptimizerOptions zo;
  zo.stage(stage)
      .dtype(dtype)
      .reduce_bucket_size(static_cast<int64_t>(bucket_size_in_m * (1 << 20)))
      .overlap_communication(o.overlap_communication())
      .max_norm(o.max_norm())
      .loss_scaler(loss_scaler_options(o))
      .cpu_offload(o.cpu_offload());
  if (!o.communication_dtype().empty()) {
    zo.communication_dtype(parse_precision(
        o.communication_dtype(), plugin, "communication_dtype"));
  }
  return zo;
}

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
