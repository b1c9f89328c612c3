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

  // Parts: under pipelines and expert parallelism each rank holds part of
  // the model, a stage's layers and, of their experts, this expert-parallel
  // rank's. Part index = stage x ep_size + expert-parallel rank.
  bool partitioned = false;
  int part = 0;
  // The parameters this part holds.
  std::set<std::string> held;
  // The part that writes each parameter and buffer (the first stage
  // holding it; an expert's own expert-parallel rank, else rank 0; buffers
  // outside every stage's layers: part 0).
  std::map<std::string, int> owner;
  // Per part, the global rank that writes it or sends its tensors to the
  // writer (its tp / sp / dp rank 0).
  std::vector<int> part_source;
  // Optimizer ids in checkpoints number the whole model's parameters, as
  // the optimizer held them before each part released the others' (as
  // ColossalAI's param_info does): this part's id -> checkpoint id, the
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
