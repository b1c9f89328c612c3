#pragma once

// Hybrid sharding's groups (internal): FSDP's kHybridShard and the ZeRO
// plugins' extra_dp_size.

#include <colossalai/distributed/process_group.h>

#include <string>

namespace colossalai {
namespace zero {
namespace detail {

struct HybridGroups {
  /// The `shard_size` consecutive ranks of `dp` that share one copy of the
  /// shards with this rank; null where shard_size is 1.
  distributed::ProcessGroupPtr shards;
  /// The ranks holding the same shard in the other copies (stride
  /// shard_size); null where there is one copy.
  distributed::ProcessGroupPtr replicas;
};

/// `dp` split into copies of `shard_size` consecutive ranks; shard_size
/// divides dp's size. Group names start with `prefix`.
HybridGroups hybrid_groups(
    const distributed::ProcessGroupPtr& dp,
    int shard_size,
    const std::string& prefix);

} // namespace detail
} // namespace zero
} // namespace colossalai
