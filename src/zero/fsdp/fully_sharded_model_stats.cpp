// FullyShardedModel's queries: its units, execution order, memory and
// placement statistics, and prefetch count.

#include "state.h"

namespace colossalai {
namespace zero {

std::vector<std::string> FullyShardedModel::unit_names() const {
  std::vector<std::string> out;
  for (const auto& u : state_->units) {
    out.push_back(u.name);
  }
  return out;
}

std::vector<int64_t> FullyShardedModel::unit_numels() const {
  std::vector<int64_t> out;
  for (const auto& u : state_->units) {
    out.push_back(u.full.numel());
  }
  return out;
}

std::vector<std::string> FullyShardedModel::execution_order() const {
  std::vector<std::string> out;
  for (size_t s : state_->order) {
    out.push_back(state_->scopes[s].name);
  }
  return out;
}

FullyShardedMemoryStats FullyShardedModel::memory_stats() const {
  return state_->measure();
}

PlacementStats FullyShardedModel::placement_stats() const {
  return state_->placement->stats();
}

FullyShardedMemoryStats FullyShardedModel::peak_memory_stats() const {
  return state_->peak;
}

void FullyShardedModel::reset_peak_memory_stats() {
  state_->placement->reset_peak();
  state_->peak = state_->measure();
}

bool FullyShardedModel::fp8_communication() const {
  return state_->fp8_shard || state_->fp8_replicate;
}

int64_t FullyShardedModel::prefetch_count() const {
  return state_->prefetches;
}

} // namespace zero
} // namespace colossalai
