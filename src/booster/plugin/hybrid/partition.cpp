// HybridParallelPlugin's parts: under pipelines and expert parallelism
// each rank holds part of the model (NOTE [Hybrid pipeline], NOTE [Expert
// parallelism]); what it does not hold is released, and checkpoints know
// which part writes each tensor.

#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/pipeline/stage_manager.h>

#include "checkpoint_io.h"

#include <algorithm>
#include <unordered_set>

namespace colossalai {
namespace booster {
namespace plugin {

namespace {

constexpr const char* kMoeName = "MoeHybridParallelPlugin";

} // namespace

void HybridParallelPlugin::apply_expert_parallel(
    torch::nn::Module& module,
    std::set<std::string>& held) {
  TORCH_CHECK(
      !info_.expert_owner.empty(),
      kMoeName,
      ": ep_size ",
      options_.ep_size(),
      " needs a model with experts, and ",
      policy_->name(),
      " split none (a mixture-of-experts family of colossalai::models, or a "
      "custom_policy that fills ShardInfo::expert_owner); use ep_size(1)");
  if (options_.pp_size() == 1) {
    for (const auto& item : module.named_parameters(true)) {
      held.insert(item.key());
    }
  }
  const int me = ep_group_->rank();
  for (const auto& kv : info_.expert_owner) {
    TORCH_CHECK(
        module.named_parameters(true).contains(kv.first),
        kMoeName,
        ": the policy names an expert parameter '",
        kv.first,
        "' that the model does not have");
    if (kv.second != me) {
      held.erase(kv.first);
    }
  }
}

void HybridParallelPlugin::release_other_parts(
    torch::nn::Module& module,
    interface::OptimizerWrapper& optimizer,
    const std::set<std::string>& held) {
  const auto& st = state_;
  auto named = module.named_parameters(true);
  // Checkpoints number the optimizer's parameters as it holds them now,
  // before the release.
  {
    std::unordered_map<const void*, std::string> name_of;
    for (const auto& item : named) {
      name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
    }
    st->global_id.clear();
    st->global_groups.clear();
    st->global_name.clear();
    int64_t id = 0;
    for (const auto& group : optimizer_param_names(optimizer, name_of)) {
      st->global_groups.emplace_back();
      for (const auto& name : group) {
        if (held.count(name)) {
          st->global_id.push_back(id);
        }
        st->global_name.push_back(name);
        st->global_groups.back().push_back(id++);
      }
    }
  }
  // Storage freed, no gradient, out of the optimizer.
  std::unordered_set<const void*> released;
  {
    at::NoGradGuard no_grad;
    for (auto& item : named) {
      if (!held.count(item.key())) {
        auto& p = item.value();
        released.insert(p.unsafeGetTensorImpl());
        p.set_data(at::empty({0}, p.options()));
        p.requires_grad_(false);
      }
    }
  }
  auto is_released = [&](const at::Tensor& p) {
    return released.count(p.unsafeGetTensorImpl()) > 0;
  };
  for (auto& g : optimizer.param_groups()) {
    auto& ps = g.params();
    ps.erase(std::remove_if(ps.begin(), ps.end(), is_released), ps.end());
  }
  for (auto& chunk : chunk_params_) { // other ranks' experts in our stage
    chunk.erase(
        std::remove_if(chunk.begin(), chunk.end(), is_released), chunk.end());
  }
  // Parts: stage x ep_size + expert-parallel rank. The stage of each tensor
  // is apply_pipeline's (0 without pipeline); an expert belongs to its
  // expert-parallel rank, every other tensor to rank 0's part.
  const int ep = options_.ep_size();
  const int stage = stage_manager_ != nullptr ? stage_manager_->stage() : 0;
  auto stage_of = [&](const std::string& name) {
    auto it = st->owner.find(name);
    return it == st->owner.end() ? 0 : it->second;
  };
  std::map<std::string, int> owner;
  for (const auto& item : named) {
    auto e = info_.expert_owner.find(item.key());
    owner[item.key()] = stage_of(item.key()) * ep +
        (e == info_.expert_owner.end() ? 0 : e->second);
  }
  for (const auto& b : module.named_buffers(true)) {
    owner[b.key()] = stage_of(b.key()) * ep;
  }
  st->owner = std::move(owner);
  st->part = stage * ep + (ep > 1 ? ep_group_->rank() : 0);
  st->held = held;
  st->partitioned = true;
  // Each part's writer: its rank with every other coordinate 0.
  std::vector<int> coord(mesh_->shape().size(), 0);
  st->part_source.clear();
  for (int s = 0; s < options_.pp_size(); ++s) {
    for (int e = 0; e < ep; ++e) {
      coord[pp_axis_] = s;
      if (ep_axis_ >= 0) {
        coord[ep_axis_] = e;
      }
      st->part_source.push_back(mesh_->ravel(coord));
    }
  }
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
