#include "state.h"

#include "../../checkpoint_io/optimizer_state.h"

#include <cmath>
#include <unordered_map>
#include <unordered_set>

namespace colossalai {
namespace zero {

using detail::FsdpState;

namespace {

int64_t state_bytes(torch::optim::Optimizer& opt) {
  int64_t n = 0;
  for (const auto& kv : checkpoint_io::detail::optimizer_param_states(opt)) {
    for (const auto& item : kv.second) {
      if (item.key() != "step") {
        n += item.value().numel() * item.value().element_size();
      }
    }
  }
  return n;
}

} // namespace

std::shared_ptr<FullyShardedOptimizer> FullyShardedModel::shard_optimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  return std::make_shared<FullyShardedOptimizer>(std::move(optimizer), state_);
}

FullyShardedOptimizer::FullyShardedOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer,
    std::shared_ptr<FsdpState> state)
    : interface::OptimizerWrapper(std::move(optimizer)),
      state_(std::move(state)) {
  TORCH_CHECK(
      optim_->state().empty(),
      "TorchFSDPPlugin: boost the optimizer before its first step");
  std::unordered_map<const void*, at::Tensor> piece_of;
  for (auto& u : state_->units) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      piece_of.emplace(u.params[i].unsafeGetTensorImpl(), u.pieces[i]);
    }
  }
  std::unordered_set<const void*> ignored;
  for (const auto& p : state_->ignored_params) {
    ignored.insert(p.unsafeGetTensorImpl());
  }
  // The optimizer now steps this rank's piece of each parameter.
  for (auto& g : optim_->param_groups()) {
    for (auto& p : g.params()) {
      auto it = piece_of.find(p.unsafeGetTensorImpl());
      if (it != piece_of.end()) {
        p = it->second;
        continue;
      }
      TORCH_CHECK(
          ignored.count(p.unsafeGetTensorImpl()),
          "TorchFSDPPlugin: the optimizer holds a parameter (shape ",
          p.sizes(),
          ") that is not in the boosted model");
    }
  }
}

void FullyShardedOptimizer::step() {
  auto& st = *state_;
  TORCH_CHECK(
      !st.in_backward && !st.in_forward,
      "FSDP: step() during forward or backward");
  optim_->step();
  st.optimizer_bytes = state_bytes(*optim_);
  st.sample_peak();
  st.refresh_gathered(); // units kept gathered at rest see the new weights
}

void FullyShardedOptimizer::zero_grad(bool set_to_none) {
  auto clear = [set_to_none](at::Tensor p) {
    auto& g = p.mutable_grad();
    if (g.defined()) {
      g = set_to_none ? at::Tensor() : g.zero_();
    }
  };
  for (auto& u : state_->units) {
    u.shard_grad.zero_(); // the pieces' gradients are views of it
    for (const auto& p : u.params) {
      clear(p); // full gradients kept by no_sync
    }
  }
  for (const auto& p : state_->ignored_params) {
    clear(p);
  }
}

void FullyShardedOptimizer::backward(const at::Tensor& loss, bool retain) {
  TORCH_CHECK(loss.numel() == 1, "backward: the loss must be a scalar");
  loss.backward({}, retain);
}

double FullyShardedOptimizer::clip_grad_by_norm(
    double max_norm,
    double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
  auto& st = *state_;
  // Shards are disjoint (replicas hold equal ones), so the global norm
  // combines per-rank partials over the shard group.
  const bool inf = std::isinf(norm_type);
  at::Tensor local = at::zeros({1}, at::kDouble);
  for (const auto& u : st.units) {
    auto g = u.shard_grad.to(at::kDouble).abs();
    local = inf ? at::maximum(local, g.max()) : local + g.pow(norm_type).sum();
  }
  if (st.S > 1) {
    distributed::all_reduce(
        local,
        *st.shard_group,
        inf ? distributed::ReduceOp::kMax : distributed::ReduceOp::kSum)
        .wait();
  }
  const double norm = inf ? local.item<double>()
                          : std::pow(local.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& u : st.units) {
      u.shard_grad.mul_(coef);
    }
  }
  return norm;
}

void FullyShardedOptimizer::clip_grad_by_value(double clip_value) {
  for (auto& u : state_->units) {
    u.shard_grad.clamp_(-clip_value, clip_value);
  }
}

std::map<int64_t, checkpoint_io::StateDict> FullyShardedOptimizer::
    full_states() {
  auto& st = *state_;
  auto states = checkpoint_io::detail::optimizer_param_states(*optim_);
  // Parameter id -> (unit, index) by the pieces' identity.
  std::unordered_map<const void*, std::pair<size_t, size_t>> where;
  for (size_t k = 0; k < st.units.size(); ++k) {
    for (size_t i = 0; i < st.units[k].pieces.size(); ++i) {
      where.emplace(
          st.units[k].pieces[i].unsafeGetTensorImpl(), std::make_pair(k, i));
    }
  }
  int64_t id = 0;
  std::map<int64_t, checkpoint_io::StateDict> out;
  std::vector<std::vector<std::pair<size_t, int64_t>>> by_unit(st.units.size());
  for (auto& g : optim_->param_groups()) {
    for (auto& p : g.params()) {
      auto it = where.find(p.unsafeGetTensorImpl());
      if (it == where.end()) {
        if (states.count(id)) {
          out.emplace(id, states.at(id)); // ignored: held whole
        }
      } else {
        by_unit[it->second.first].emplace_back(it->second.second, id);
      }
      ++id;
    }
  }
  for (size_t k = 0; k < st.units.size(); ++k) {
    auto& u = st.units[k];
    if (by_unit[k].empty()) {
      continue;
    }
    // Keys come from the first parameter with state; every rank has state
    // for the same parameters (all pieces get gradients).
    const checkpoint_io::StateDict* first = nullptr;
    for (const auto& e : by_unit[k]) {
      if (states.count(e.second)) {
        first = &states.at(e.second);
        break;
      }
    }
    if (first == nullptr) {
      continue;
    }
    std::map<int64_t, checkpoint_io::StateDict> unit_out;
    for (const auto& item : *first) {
      const auto& key = item.key();
      if (item.value().dim() == 0) { // step counters: equal on every rank
        for (const auto& e : by_unit[k]) {
          if (states.count(e.second)) {
            unit_out[e.second].insert(key, states.at(e.second)[key]);
          }
        }
        continue;
      }
      auto local = at::zeros({u.shard}, item.value().options());
      for (const auto& e : by_unit[k]) {
        if (!states.count(e.second)) {
          continue;
        }
        const auto& range = u.ranges[e.first];
        if (range.len > 0) {
          local.narrow(0, range.in_shard, range.len)
              .copy_(states.at(e.second)[key].reshape({-1}));
        }
      }
      auto full = at::empty({u.padded()}, local.options());
      if (st.S > 1) {
        distributed::all_gather(full, local, *st.shard_group).wait();
      } else {
        full.copy_(local);
      }
      for (const auto& e : by_unit[k]) {
        if (states.count(e.second)) {
          const auto& p = u.params[e.first];
          unit_out[e.second].insert(
              key,
              full.narrow(0, u.offsets[e.first], p.numel()).view(p.sizes()));
        }
      }
    }
    for (auto& kv : unit_out) {
      out.emplace(kv.first, std::move(kv.second));
    }
  }
  return out;
}

void FullyShardedOptimizer::load_full_state(
    int64_t id,
    const checkpoint_io::StateDict& state,
    const std::string& file) {
  auto& st = *state_;
  // Find parameter `id` in the optimizer and, if sharded, its unit.
  int64_t n = 0;
  at::Tensor param;
  for (auto& g : optim_->param_groups()) {
    for (auto& p : g.params()) {
      if (n++ == id) {
        param = p;
      }
    }
  }
  TORCH_CHECK(
      param.defined(),
      "optimizer checkpoint '",
      file,
      "' has state for parameter ",
      id,
      " but the optimizer has ",
      n);
  for (auto& u : st.units) {
    for (size_t i = 0; i < u.pieces.size(); ++i) {
      if (!u.pieces[i].is_same(param)) {
        continue;
      }
      const auto& p = u.params[i];
      const auto& range = u.ranges[i];
      checkpoint_io::StateDict piece;
      for (const auto& item : state) {
        if (item.value().dim() == 0) {
          piece.insert(item.key(), item.value());
          continue;
        }
        checkpoint_io::detail::check_state_numel(
            file, item.key(), id, item.value().numel(), p.numel());
        piece.insert(
            item.key(),
            item.value()
                .reshape({-1})
                .narrow(0, range.in_param, range.len)
                .clone());
      }
      checkpoint_io::detail::load_param_state(*optim_, id, piece, file);
      return;
    }
  }
  checkpoint_io::detail::load_param_state(*optim_, id, state, file);
}

} // namespace zero
} // namespace colossalai
