#pragma once

#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>

#include <string>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

/// What HybridParallelPlugin's options resolve to, once checked.
struct HybridLayout {
  at::ScalarType dtype = at::kFloat;
  /// The sequence-parallel mode (kNone when off).
  shardformer::SequenceParallelMode sp_mode =
      shardformer::SequenceParallelMode::kNone;
  /// Ranks a sequence is split over (the tensor group's size under
  /// split_gather and ring).
  int sp_size = 1;
  /// The mesh's own sp axis (1 when sequences split over the tensor group).
  int sp_axis_size = 1;
  int dp_size = 1;
  /// Expert parallelism: dp_size = moe_dp_size x ep_size.
  int ep_size = 1;
  int moe_dp_size = 1;
};

/// Checks every option against the others and the world size; an error
/// names the option and what to set instead. `experts`: the options of
/// MoeHybridParallelPlugin (ep_size may exceed 1).
HybridLayout check_hybrid_options(
    const HybridParallelPluginOptions& o,
    int world,
    bool experts = false);

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
