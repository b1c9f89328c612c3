#include "state.h"

#include <colossalai/utils/compat.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

namespace colossalai {
namespace zero {
namespace detail {

namespace {

int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

} // namespace

bool FsdpState::reshard_after_forward(const Unit& u) const {
  // The root's backward starts right after forward, so it stays gathered
  // (as in PyTorch).
  const auto s = o.sharding_strategy();
  return !u.root &&
      (s == ShardingStrategy::kFullShard ||
       s == ShardingStrategy::kHybridShard);
}

void FsdpState::launch_gather(size_t k) {
  auto& u = units[k];
  if (u.aliased || u.gathered || u.gathering || u.numel == 0) {
    return;
  }
  const auto nbytes =
      static_cast<size_t>(u.full.numel()) * u.full.element_size();
  if (compat::storage_nbytes(u.full) == 0) {
    compat::allocate_storage(u.full, nbytes);
  }
  // The shard (cast and moved only when needed); never a view of `full`.
  auto src = u.shard_data.to(device, param_dtype);
  if (S == 1) {
    u.full.copy_(src);
    u.gathered = true;
    return;
  }
  u.gather_src = src;
  u.gather_work = distributed::all_gather(u.full, u.gather_src, *shard_group);
  u.gathering = true;
}

void FsdpState::wait_gather(size_t k) {
  auto& u = units[k];
  if (!u.gathering) {
    return;
  }
  u.gathering = false;
  u.gather_work.wait();
  u.gather_work = distributed::Work();
  u.gather_src = at::Tensor();
  u.gathered = true;
  sample_peak();
}

void FsdpState::reshard(size_t k) {
  auto& u = units[k];
  if (u.aliased || u.numel == 0) {
    return;
  }
  wait_gather(k);
  if (u.gathered) {
    compat::free_storage(u.full);
    u.gathered = false;
  }
}

void FsdpState::refresh_gathered() {
  for (size_t k = 0; k < units.size(); ++k) {
    auto& u = units[k];
    if (u.gathered && !u.aliased) {
      u.gathered = false; // storage stays allocated; refill it
      launch_gather(k);
    }
  }
  for (size_t k = 0; k < units.size(); ++k) {
    wait_gather(k);
  }
}

c10::optional<size_t> FsdpState::backward_next(size_t k) const {
  auto it = std::find(order.begin(), order.end(), k);
  if (it == order.end() || it == order.begin()) {
    return c10::nullopt;
  }
  return *(it - 1);
}

c10::optional<size_t> FsdpState::forward_next(size_t k) const {
  auto it = std::find(order.begin(), order.end(), k);
  if (it == order.end() || it + 1 == order.end()) {
    return c10::nullopt;
  }
  return *(it + 1);
}

void FsdpState::root_pre_forward() {
  TORCH_CHECK(
      !summoned,
      "FSDP: forward inside summon_full_params(); end the guard first");
  TORCH_CHECK(
      !in_backward, "FSDP: forward while a backward pass is in progress");
  in_forward = true;
  recording = !order_recorded;
  ensure_gathered(0);
  if (o.forward_prefetch() && !order.empty()) {
    launch_gather(order.front());
  }
}

void FsdpState::root_post_forward() {
  in_forward = false;
  if (recording) {
    recording = false;
    order_recorded = true;
  }
  if (!torch::autograd::GradMode::is_enabled() && reshard_at_rest()) {
    // No backward follows a no-grad forward: release everything now.
    for (size_t k = 0; k < units.size(); ++k) {
      reshard(k);
    }
  }
}

void FsdpState::enter_unit(size_t k) {
  TORCH_CHECK(
      in_forward,
      "FSDP: unit '",
      units[k].name,
      "' ran outside the boosted model's forward; call the model "
      "through the BoostedModel the booster returned");
  if (recording && std::find(order.begin(), order.end(), k) == order.end()) {
    order.push_back(k);
  }
  ensure_gathered(k);
  if (o.forward_prefetch()) {
    if (auto next = forward_next(k)) {
      launch_gather(*next);
    }
  }
}

at::Tensor FsdpState::exit_unit(size_t k, const at::Tensor& output) {
  if (torch::autograd::GradMode::is_enabled() && output.requires_grad()) {
    std::weak_ptr<FsdpState> weak = shared_from_this();
    output.register_hook([weak, k](const at::Tensor&) {
      if (auto self = weak.lock()) {
        self->pre_backward(k);
      }
    });
  }
  if (reshard_after_forward(units[k]) ||
      (!torch::autograd::GradMode::is_enabled() && reshard_at_rest())) {
    reshard(k);
  }
  return output;
}

void FsdpState::begin_backward() {
  if (in_backward) {
    return;
  }
  in_backward = true;
  std::weak_ptr<FsdpState> weak = shared_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak]() {
    if (auto self = weak.lock()) {
      self->finalize_backward();
    }
  });
}

void FsdpState::pre_backward(size_t k) {
  begin_backward();
  ensure_gathered(k);
  if (o.backward_prefetch() == BackwardPrefetch::kBackwardPre) {
    if (auto next = backward_next(k)) {
      if (!units[*next].gathered && !units[*next].gathering &&
          !units[*next].aliased) {
        ++prefetches;
      }
      launch_gather(*next);
    }
  }
}

void FsdpState::on_grad(size_t k, size_t /*i*/) {
  begin_backward();
  auto& u = units[k];
  if (++u.grads_ready == u.grads_expected) {
    unit_grads_done(k);
  }
}

void FsdpState::unit_grads_done(size_t k) {
  auto& u = units[k];
  // Gradients only grow until a unit completes, so its peak is now.
  sample_peak();
  u.grads_done = true;
  if (require_sync) {
    reduce(k);
  }
  if (reshard_at_rest()) {
    reshard(k);
  }
  if (o.backward_prefetch() == BackwardPrefetch::kBackwardPost) {
    if (auto next = backward_next(k)) {
      if (!units[*next].gathered && !units[*next].gathering &&
          !units[*next].aliased) {
        ++prefetches;
      }
      launch_gather(*next);
    }
  }
}

void FsdpState::reduce(size_t k) {
  auto& u = units[k];
  auto flat = at::empty({u.padded()}, u.full.options().dtype(reduce_dtype));
  if (u.padded() > u.numel) {
    flat.narrow(0, u.numel, u.padded() - u.numel).zero_();
  }
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto dst = flat.narrow(0, u.offsets[i], u.params[i].numel());
    auto& g = u.params[i].mutable_grad();
    if (g.defined()) {
      dst.copy_(g.reshape({-1}));
      g = at::Tensor(); // the full gradient is no longer needed
    } else {
      dst.zero_(); // unused in this backward
    }
  }
  flat.div_(S * R); // average; keeps low-precision sums in range
  u.flat_grad = flat;
  if (S > 1) {
    u.reduced = at::empty({u.shard}, flat.options());
    u.reduce_work = distributed::reduce_scatter(u.reduced, flat, *shard_group);
  } else {
    u.reduced = flat;
    u.reduce_work = R > 1 ? distributed::all_reduce(u.reduced, *replicate_group)
                          : distributed::Work();
  }
  u.reducing = true;
  reducing.push_back(k);
  sample_peak();
  // Bound gradient memory: at most two reductions in flight.
  while (reducing.size() > 2) {
    consume(reducing.front());
    reducing.pop_front();
  }
}

void FsdpState::consume(size_t k) {
  auto& u = units[k];
  u.reduce_work.wait();
  u.reduce_work = distributed::Work();
  if (S > 1 && R > 1) {
    distributed::all_reduce(u.reduced, *replicate_group).wait();
  }
  u.shard_grad.add_(u.reduced.to(shard_device, at::kFloat));
  u.flat_grad = at::Tensor();
  u.reduced = at::Tensor();
  u.reducing = false;
}

void FsdpState::finalize_backward() {
  try {
    for (size_t k = 0; k < units.size(); ++k) {
      auto& u = units[k];
      if (!u.grads_done && u.grads_expected > 0) {
        // Units (or parameters) this backward did not reach: their
        // gradients are zero, but every rank must take part.
        if (require_sync) {
          reduce(k);
        }
        u.grads_done = true;
      }
    }
    while (!reducing.empty()) {
      consume(reducing.front());
      reducing.pop_front();
    }
    for (size_t k = 0; k < units.size(); ++k) {
      if (reshard_at_rest()) {
        reshard(k); // includes units prefetched but never used
      }
    }
  } catch (...) {
    for (auto& u : units) {
      u.grads_ready = 0;
      u.grads_done = false;
    }
    reducing.clear();
    in_backward = false;
    throw;
  }
  for (auto& u : units) {
    u.grads_ready = 0;
    u.grads_done = false;
  }
  in_backward = false;
  sample_peak();
}

FullyShardedMemoryStats FsdpState::measure() const {
  FullyShardedMemoryStats s;
  for (const auto& u : units) {
    if (!u.aliased && u.full.defined()) {
      s.gathered_params += static_cast<int64_t>(compat::storage_nbytes(u.full));
      s.gathered_params += bytes_of(u.gather_src);
    }
    s.shards += bytes_of(u.shard_data);
    s.gradients += bytes_of(u.shard_grad) + bytes_of(u.flat_grad);
    if (u.reduced.defined() && !u.reduced.is_same(u.flat_grad)) {
      s.gradients += bytes_of(u.reduced);
    }
    for (const auto& p : u.params) {
      s.gradients += bytes_of(p.grad());
    }
  }
  s.optimizer_states = optimizer_bytes;
  return s;
}

void FsdpState::sample_peak() {
  auto now = measure();
  if (now.total() > peak.total()) {
    peak = now;
  }
}

} // namespace detail
} // namespace zero
} // namespace colossalai
