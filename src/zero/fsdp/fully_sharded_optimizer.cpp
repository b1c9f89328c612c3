#include <colossalai/checkpoint_io/optimizer_state.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>

#include "../../distributed/raised_backward.h"
#include "state.h"

#include <unordered_map>
#include <vector>

namespace colossalai {
namespace zero {

using detail::FsdpState;

namespace {

// Optimizer state bytes per unit (placement accounts them in the unit's
// tier) and in all (ignored parameters' included).
int64_t state_bytes(torch::optim::Optimizer& opt, FsdpState& st) {
  std::unordered_map<const void*, size_t> unit_of;
  for (size_t k = 0; k < st.units.size(); ++k) {
    st.units[k].optim_bytes = 0;
    for (const auto& piece : st.units[k].pieces) {
      unit_of.emplace(piece.unsafeGetTensorImpl(), k);
    }
  }
  std::vector<const void*> ids;
  for (auto& g : opt.param_groups()) {
    for (auto& p : g.params()) {
      ids.push_back(p.unsafeGetTensorImpl());
    }
  }
  int64_t n = 0;
  // States HybridAdam keeps in files stay there (undefined here).
  for (const auto& kv : checkpoint_io::detail::optimizer_param_states(
           opt, /*fetch_offloaded=*/false)) {
    int64_t b = 0;
    for (const auto& item : kv.second) {
      if (item.key() != "step") {
        b += detail::bytes_of(item.value());
      }
    }
    n += b;
    auto it = kv.first < static_cast<int64_t>(ids.size())
        ? unit_of.find(ids[kv.first])
        : unit_of.end();
    if (it != unit_of.end()) {
      st.units[it->second].optim_bytes += b;
    }
  }
  return n;
}

ShardedOptimizerOptions with_scaler(
    ShardedOptimizerOptions o,
    const FsdpState& st) {
  // fp16 gradients underflow without loss scaling.
  if (st.param_dtype == at::kHalf && !o.loss_scaler()) {
    o.loss_scaler(amp::DynamicLossScalerOptions());
  }
  return o;
}

// Gemini's device margin (the first step under auto): units move there
// with the states the optimizer holds for their pieces, if any.
void use_device_margin(torch::optim::Optimizer& opt, FsdpState& st) {
  const auto states = checkpoint_io::detail::optimizer_param_states(
      opt, /*fetch_offloaded=*/false);
  std::unordered_map<const void*, int64_t> index; // the states' ids
  int64_t id = 0;
  for (auto& g : opt.param_groups()) {
    for (auto& p : g.params()) {
      index.emplace(p.unsafeGetTensorImpl(), id++);
    }
  }
  // The unit's state tensors; false where one is kept in a file.
  auto states_of = [&](const detail::Unit& u, std::vector<at::Tensor>& out) {
    bool in_memory = true;
    for (const auto& piece : u.pieces) {
      auto it = index.find(piece.unsafeGetTensorImpl());
      auto found = it == index.end() ? states.end() : states.find(it->second);
      if (found == states.end()) {
        continue; // no state yet: the optimizer creates it on the device
      }
      for (const auto& item : found->second) {
        if (item.key() != "step") { // a count, made for the list
          in_memory = in_memory && item.value().defined();
          out.push_back(item.value());
        }
      }
    }
    return in_memory;
  };
  gemini::Placement::StateMover mover;
  mover.movable = [&](const detail::Unit& u) {
    std::vector<at::Tensor> unused;
    return states_of(u, unused);
  };
  mover.move = [&](const detail::Unit& u, at::Device device) {
    std::vector<at::Tensor> ts;
    states_of(u, ts);
    for (auto& t : ts) {
      t.set_data(t.to(device)); // in place: the state objects keep them
    }
  };
  st.placement->before_step(mover);
}

} // namespace

std::shared_ptr<FullyShardedOptimizer> FullyShardedModel::shard_optimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer,
    ShardedOptimizerOptions options) {
  return std::make_shared<FullyShardedOptimizer>(
      std::move(optimizer), state_, std::move(options));
}

FullyShardedOptimizer::FullyShardedOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer,
    std::shared_ptr<FsdpState> state,
    ShardedOptimizerOptions options)
    : ShardedOptimizer(std::move(optimizer), with_scaler(options, *state)),
      state_(std::move(state)) {
  std::vector<detail::FlatParams*> groups;
  for (auto& u : state_->units) {
    groups.push_back(&u);
  }
  // Replicas (HYBRID_SHARD, NO_SHARD) hold equal shards: the norm and the
  // overflow flag combine over the shard group alone.
  shard_param_groups(
      "TorchFSDPPlugin",
      std::move(groups),
      state_->S > 1 ? state_->shard_group : nullptr,
      state_->ignored_params);
  if (state_->o.overlap_host_step()) {
    overlap_host_step();
  }
}

void FullyShardedOptimizer::overlap_host_step() {
  std::weak_ptr<nn::optimizer::HybridAdam> weak_optimizer =
      host_step_ahead_optimizer("GeminiPlugin", state_->ahead);
  std::weak_ptr<FsdpState> weak_state = state_;
  state_->step_ahead = [weak_optimizer, weak_state](size_t k) {
    auto optimizer = weak_optimizer.lock();
    auto st = weak_state.lock();
    if (optimizer && st) {
      const auto& u = st->units[k];
      detail::step_group_ahead(
          *optimizer, u, k, st->host_copies, u.param_shard, st->device,
          st->ahead);
    }
  };
}

void FullyShardedOptimizer::step() {
  distributed::detail::guard_step([this] {
    auto& st = *state_;
    TORCH_CHECK(
        !st.in_backward() && !st.in_forward,
        "FSDP: step() during forward or backward");
    st.placement->begin_step();
    for (size_t k : finish_steps_ahead(st.device)) {
      st.placement->refreshed_ahead(k); // after_step skips them
    }
    if (st.placement->margin_pending()) {
      use_device_margin(*optim_, st);
    }
    ShardedOptimizer::step();
  });
}

bool FullyShardedOptimizer::publishes_during_step() const {
  return true; // units with host fp32 shards and device parameter shards
}

bool FullyShardedOptimizer::group_stepped_on_host(size_t k) {
  return state_->placement->refresh_param_shard(k);
}

void FullyShardedOptimizer::after_step() {
  auto& st = *state_;
  st.optimizer_bytes = state_bytes(*optim_, st);
  st.placement->after_step(); // device parameter shards see the new weights
  st.sample_peak();
  st.refresh_gathered(); // units kept gathered at rest see the new weights
}

void FullyShardedOptimizer::zero_extra_grads(bool set_to_none) {
  auto clear = [set_to_none](at::Tensor p) {
    auto& g = p.mutable_grad();
    if (g.defined()) {
      g = set_to_none ? at::Tensor() : g.zero_();
    }
  };
  for (auto& u : state_->units) {
    for (const auto& p : u.params) {
      clear(p); // full gradients kept by no_sync
    }
  }
  for (const auto& p : state_->ignored_params) {
    clear(p);
  }
}

} // namespace zero
} // namespace colossalai
