#pragma once

// HybridParallelPlugin's checkpoint state access (internal): whole Hugging
// Face-layout tensors at any tp / pp / dp size.

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/placement/placement.h>
#include <colossalai/shardformer/policy.h>
#include <colossalai/zero/low_level_optimizer.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace colossalai {
namespace booster {
namespace plugin {

// The optimizer's parameters' names (`name_of`: by tensor identity), by
// group; an error for a parameter the model does not have.
std::vector<std::vector<std::string>> optimizer_param_names(
    interface::OptimizerWrapper& optimizer,
    const std::unordered_map<const void*, std::string>& name_of);

// What the plugin learned at boost, shared with its checkpoint IO.
struct HybridState {
  // Where each held parameter lives: how it is split over "tp" and its
  // whole shape (NOTE [Placement table]).
  std::shared_ptr<const placement::PlacementTable> table;
  distributed::ProcessGroupPtr tp;
  // By (this rank's) optimizer parameter id: its name and local shape.
  std::vector<std::string> name_by_id;
  std::vector<std::vector<int64_t>> local_shape_by_id;
  std::weak_ptr<zero::LowLevelZeroOptimizer> zero;

  // Pipelines.
  bool pipelined = false;
  int stage = 0;
  // The parameters this stage holds.
  std::set<std::string> held;
  // The stage that writes each parameter and buffer (the first that holds
  // it; buffers outside every stage's layers: stage 0).
  std::map<std::string, int> owner;
  // Per stage, the global rank that writes its part or sends its tensors to
  // the writer (its tp / sp / dp rank 0).
  std::vector<int> stage_source;
  // Optimizer ids in checkpoints number the whole model's parameters, as
  // the optimizer held them before each stage released the others' (as
  // ColossalAI's param_info does): this stage's id -> checkpoint id, the
  // checkpoint ids per param group, and each checkpoint id's parameter.
  std::vector<int64_t> global_id;
  std::vector<std::vector<int64_t>> global_groups;
  std::vector<std::string> global_name;

  int owner_of(const std::string& name) const {
    auto it = owner.find(name);
    return it == owner.end() ? 0 : it->second;
  }
};

std::shared_ptr<checkpoint_io::StateAccess> hybrid_state_access(
    std::shared_ptr<HybridState> state);

} // namespace plugin
} // namespace booster
} // namespace colossalai
