#include "hybrid_groups.h"

#include <vector>

namespace colossalai {
namespace zero {
namespace detail {

HybridGroups hybrid_groups(
    const distributed::ProcessGroupPtr& dp,
    int shard_size,
    const std::string& prefix) {
  const int world = dp->size();
  const int h = shard_size;
  TORCH_INTERNAL_ASSERT(h > 0 && world % h == 0);
  const int me = dp->rank();
  std::vector<int> shard_ranks, replica_ranks;
  for (int i = 0; i < h; ++i) {
    shard_ranks.push_back(dp->global_rank(me / h * h + i));
  }
  for (int j = 0; j < world / h; ++j) {
    replica_ranks.push_back(dp->global_rank(j * h + me % h));
  }
  HybridGroups g;
  if (h > 1) {
    g.shards = distributed::new_group(
        shard_ranks, prefix + "_shard_" + std::to_string(shard_ranks[0]));
  }
  if (world / h > 1) {
    g.replicas = distributed::new_group(
        replica_ranks,
        prefix + "_replicate_" + std::to_string(replica_ranks[0]));
  }
  return g;
}

} // namespace detail
} // namespace zero
} // namespace colossalai
