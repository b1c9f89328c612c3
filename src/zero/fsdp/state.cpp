#include "state.h"

#include <colossalai/nn/checkpoint.h>
#include <colossalai/quantization/fp8.h>

#include <colossalai/utils/compat.h>

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <exception>

namespace colossalai {
namespace zero {
namespace detail {

bool FsdpState::reshard_after_forward(const Unit& u) const {
  // The root's backward starts right after forward, so it stays gathered
  // (as in PyTorch).
  const auto s = o.sharding_strategy();
  return !u.root &&
      (s == ShardingStrategy::kFullShard ||
       s == ShardingStrategy::kHybridShard);
}

void FsdpState::launch_gather(size_t k, bool prefetch) {
  auto& u = units[k];
  if (u.aliased || u.gathered || u.gathering || u.numel() == 0) {
    return;
  }
  // The shard on the device, never a view of `full`: in param_dtype, or at
  // one rank possibly the float32 shard itself (the copy converts).
  auto src = placement->gather_source(k, prefetch);
  if (!src.defined()) {
    return; // a prefetch with no room: gathered when needed instead
  }
  const auto nbytes =
      static_cast<size_t>(u.full.numel()) * u.full.element_size();
  if (compat::storage_nbytes(u.full) == 0) {
    compat::allocate_storage(u.full, nbytes);
  }
  if (S == 1) {
    u.full.copy_(src);
    u.gathered = true;
    return;
  }
  u.gather_src = src;
  u.gather_work = fp8_shard
      ? quantization::all_gather_fp8(u.full, u.gather_src, *shard_group, "e4m3")
      : distributed::all_gather(u.full, u.gather_src, *shard_group);
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
  if (u.aliased || u.keep_gathered || u.numel() == 0) {
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

c10::optional<size_t> FsdpState::backward_next(size_t s) const {
  auto it = std::find(order.begin(), order.end(), s);
  if (it == order.end() || it == order.begin()) {
    return c10::nullopt;
  }
  return *(it - 1);
}

c10::optional<size_t> FsdpState::forward_next(size_t s) const {
  auto it = std::find(order.begin(), order.end(), s);
  if (it == order.end() || it + 1 == order.end()) {
    return c10::nullopt;
  }
  return *(it + 1);
}

void FsdpState::gather_scope(size_t s) {
  for (size_t k : scopes[s].units) {
    launch_gather(k);
  }
  for (size_t k : scopes[s].units) {
    wait_gather(k);
  }
}

void FsdpState::prefetch_scope(size_t s) {
  for (size_t k : scopes[s].units) {
    const bool idle = !units[k].gathered && !units[k].gathering;
    launch_gather(k, /*prefetch=*/true);
    if (idle && units[k].gathering) {
      ++prefetches;
    }
  }
}

void FsdpState::root_pre_forward() {
  TORCH_CHECK(
      !summoned,
      "FSDP: forward inside summon_full_params(); end the guard first");
  TORCH_CHECK(
      !in_backward(), "FSDP: forward while a backward pass is in progress");
  in_forward = true;
  exceptions_at_forward = std::uncaught_exceptions();
  recording = !order_recorded;
  placement->begin_forward();
  placement->moment();
  gather_scope(0);
  for (size_t k : scopes[0].units) {
    ++open_scopes[k];
  }
  if (o.forward_prefetch() && !order.empty()) {
    for (size_t k : scopes[order.front()].units) {
      launch_gather(k, /*prefetch=*/true);
    }
  }
}

void FsdpState::root_post_forward() {
  in_forward = false;
  for (size_t k : scopes[0].units) {
    --open_scopes[k];
  }
  if (recording) {
    recording = false;
    if (std::uncaught_exceptions() > exceptions_at_forward) {
      order.clear(); // it raised partway: the order is the next forward's
    } else {
      order_recorded = true;
    }
  }
  if (!torch::autograd::GradMode::is_enabled() && reshard_at_rest()) {
    // No backward follows a no-grad forward: release everything now.
    for (size_t k = 0; k < units.size(); ++k) {
      reshard(k);
    }
  }
}

void FsdpState::enter_scope(size_t s) {
  // A checkpointed unit runs again in backward: it gathers as its backward
  // would (the pre-backward hook of its new output then finds it gathered).
  const bool recompute = !in_forward && nn::in_checkpoint_recompute();
  TORCH_CHECK(
      in_forward || recompute,
      "FSDP: unit '",
      scopes[s].name,
      "' ran outside the boosted model's forward; call the model "
      "through the BoostedModel the booster returned");
  if (recompute) {
    placement->moment();
    gather_scope(s);
    for (size_t k : scopes[s].units) {
      ++open_scopes[k];
    }
    return;
  }
  if (recording && std::find(order.begin(), order.end(), s) == order.end()) {
    order.push_back(s);
  }
  placement->moment();
  gather_scope(s);
  for (size_t k : scopes[s].units) {
    ++open_scopes[k];
  }
  if (o.forward_prefetch()) {
    if (auto next = forward_next(s)) {
      for (size_t k : scopes[*next].units) {
        launch_gather(k, /*prefetch=*/true);
      }
    }
  }
}

at::Tensor FsdpState::exit_scope(size_t s, const at::Tensor& output) {
  if (torch::autograd::GradMode::is_enabled() && output.requires_grad()) {
    std::weak_ptr<FsdpState> weak = shared_from_this();
    output.register_hook([weak, s](const at::Tensor&) {
      if (auto self = weak.lock()) {
        self->pre_backward(s);
      }
    });
  }
  const bool no_grad = !torch::autograd::GradMode::is_enabled();
  // A recomputation's backward comes next: the unit stays gathered for it
  // and reshards when its gradients are reduced (on_bucket_ready).
  const bool recompute = !in_forward && nn::in_checkpoint_recompute();
  for (size_t k : scopes[s].units) {
    // A unit another open scope still uses stays (chunks shared by scopes).
    if (--open_scopes[k] == 0 && !recompute &&
        (reshard_after_forward(units[k]) || (no_grad && reshard_at_rest()))) {
      reshard(k);
    }
  }
  return output;
}

void FsdpState::before_backward() {
  TORCH_CHECK(
      !ahead->pending(),
      ahead->raised() ? kRaisedBackwardAhead : kSecondBackwardAhead);
}

void FsdpState::pre_backward(size_t s) {
  bucketer->begin_backward();
  placement->moment();
  gather_scope(s);
  if (o.backward_prefetch() == BackwardPrefetch::kBackwardPre) {
    if (auto next = backward_next(s)) {
      prefetch_scope(*next);
    }
  }
}

void FsdpState::fill(size_t param, bool /*used*/) {
  const auto [k, i] = grad_params[param];
  auto& u = units[k];
  if (!u.flat_grad.defined()) {
    u.flat_grad = u.layout.empty_flat(u.full.options().dtype(reduce_dtype));
    // Parameters that do not require grad have no slot to fill.
    for (size_t j = 0; j < u.params.size(); ++j) {
      if (!u.params[j].requires_grad()) {
        u.layout.copy_into(u.flat_grad, j, at::Tensor());
      }
    }
  }
  auto& g = u.params[i].mutable_grad();
  u.layout.copy_into(u.flat_grad, i, g); // zeros when unused
  g = at::Tensor(); // the full gradient is no longer needed
}

void FsdpState::on_bucket_ready(size_t bucket) {
  const size_t k = bucket_unit[bucket];
  // Gradients only grow until a unit completes, so its peak is now.
  sample_peak();
  placement->moment();
  if (bucketer->finalizing()) {
    return; // a unit backward did not reach; everything reshards next
  }
  if (reshard_at_rest()) {
    reshard(k);
  }
  if (o.backward_prefetch() == BackwardPrefetch::kBackwardPost) {
    if (auto next = backward_next(unit_scope[k])) {
      prefetch_scope(*next);
    }
  }
}

distributed::Work FsdpState::all_reduce_replicas(at::Tensor& grad) {
  return fp8_replicate
      ? quantization::all_reduce_fp8(
            grad, *replicate_group, distributed::ReduceOp::kSum, "e5m2")
      : distributed::all_reduce(grad, *replicate_group);
}

distributed::Work FsdpState::launch(size_t bucket) {
  auto& u = units[bucket_unit[bucket]];
  auto& flat = u.flat_grad;
  flat.div_(S * R); // average; keeps low-precision sums in range
  distributed::Work work;
  if (S > 1) {
    u.reduced = at::empty({u.layout.shard}, flat.options());
    if (fp8_shard) {
      work = quantization::reduce_scatter_fp8(
          u.reduced, flat, *shard_group, distributed::ReduceOp::kSum, "e5m2");
      // The FP8 rows sent and received: S of 4 + shard bytes each.
      u.staging = 2 * S * (4 + u.layout.shard);
    } else {
      work = distributed::reduce_scatter(u.reduced, flat, *shard_group);
      u.staging = distributed::reduce_scatter_workspace_bytes(
          flat.numel(), flat.scalar_type(), *shard_group);
    }
  } else {
    u.reduced = flat;
    if (R > 1) {
      work = all_reduce_replicas(u.reduced);
    }
  }
  sample_peak();
  return work;
}

void FsdpState::complete(size_t bucket) {
  auto& u = units[bucket_unit[bucket]];
  if (S > 1 && R > 1) {
    all_reduce_replicas(u.reduced).wait();
  }
  accumulate_grad(u, u.reduced, host_copies);
  if (u.offloaded) {
    placement->moved_to_host(u.reduced.numel() * u.reduced.element_size());
  }
  u.flat_grad = at::Tensor();
  u.reduced = at::Tensor();
  u.staging = 0;
  if (step_ahead && u.offloaded) {
    step_ahead(bucket_unit[bucket]);
  }
}

void FsdpState::on_finalized(bool /*synced*/) {
  host_copies.wait(); // the step reads the host gradient shards next
  ahead->note_backward_end();
  if (reshard_at_rest()) {
    for (size_t k = 0; k < units.size(); ++k) {
      reshard(k); // includes units prefetched but never used
    }
  }
  sample_peak();
}

void FsdpState::on_reset() {
  host_copies.wait();
  for (auto& u : units) {
    u.flat_grad = at::Tensor();
    u.reduced = at::Tensor();
    u.staging = 0;
  }
}

FullyShardedMemoryStats FsdpState::measure() const {
  FullyShardedMemoryStats s;
  for (const auto& u : units) {
    if (!u.aliased && u.full.defined()) {
      s.gathered_params += static_cast<int64_t>(compat::storage_nbytes(u.full));
      if (!u.gather_src.is_same(u.param_shard) &&
          !u.gather_src.is_same(u.shard_data)) {
        s.gathered_params += bytes_of(u.gather_src); // a transient copy
      }
    }
    s.shards += bytes_of(u.shard_data);
    s.param_shards += bytes_of(u.param_shard);
    s.gradients += bytes_of(u.shard_grad) + bytes_of(u.flat_grad) + u.staging;
    if (u.offloaded) {
      s.offloaded += bytes_of(u.shard_data) + bytes_of(u.shard_grad);
    }
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
  if (placement) {
    placement->sample();
  }
  auto now = measure();
  if (now.total() > peak.total()) {
    peak = now;
  }
}

} // namespace detail
} // namespace zero
} // namespace colossalai
