// FullyShardedModel's full parameters: streaming the full state for saving,
// and summon_full_params (FullParams).

#include "state.h"

#include <exception>
#include <set>

namespace colossalai {
namespace zero {

using detail::all_gather_flat;
using detail::FsdpState;

void FullyShardedModel::stream_full_state(
    const std::function<void(const std::string&, const at::Tensor&)>& sink) {
  auto& st = *state_;
  TORCH_CHECK(
      !st.in_forward && !st.in_backward() && !st.summoned,
      "FSDP: saving needs the model at rest (not inside forward, backward "
      "or summon_full_params)");
  const bool root = st.S == 1 || st.shard_rank() == 0;
  for (auto& u : st.units) {
    if (u.numel() == 0) {
      continue;
    }
    at::Tensor full;
    if (root) {
      full = at::empty({u.padded()}, u.full.options().dtype(at::kFloat));
    }
    auto src = u.shard_data.to(st.device, at::kFloat, false, /*copy=*/true);
    if (st.S > 1) {
      distributed::gather(full, src, 0, *st.shard_group).wait();
    } else {
      full.copy_(src);
    }
    if (root) {
      for (size_t i = 0; i < u.params.size(); ++i) {
        sink(u.param_names[i], u.layout.view(full, i, u.params[i].sizes()));
      }
    }
  }
  if (!root) {
    return;
  }
  std::set<const void*> ignored;
  for (const auto& p : st.ignored_params) {
    ignored.insert(p.unsafeGetTensorImpl());
  }
  auto module = unwrap();
  for (const auto& item : module->named_parameters(true)) {
    if (ignored.count(item.value().unsafeGetTensorImpl())) {
      sink(item.key(), item.value()); // held whole
    }
  }
  for (const auto& item : module->named_buffers(true)) {
    if (item.value().defined()) {
      sink(item.key(), item.value());
    }
  }
}

FullyShardedModel::FullParams FullyShardedModel::summon_full_params(
    bool writeback) {
  return FullParams(state_, writeback);
}

FullyShardedModel::FullParams::FullParams(
    std::shared_ptr<FsdpState> state,
    bool writeback)
    : state_(std::move(state)),
      writeback_(writeback),
      uncaught_(std::uncaught_exceptions()) {
  auto& st = *state_;
  TORCH_CHECK(
      !st.in_forward && !st.in_backward() && !st.summoned,
      "FSDP: summon_full_params() needs the model at rest (not inside "
      "forward, backward or another summon_full_params)");
  st.summoned = true;
  at::NoGradGuard no_grad;
  for (auto& u : st.units) {
    if (u.numel() == 0) {
      continue;
    }
    auto full = at::empty({u.padded()}, u.full.options().dtype(at::kFloat));
    auto src = u.shard_data.to(st.device, at::kFloat, false, /*copy=*/true);
    all_gather_flat(full, src, u.layout, st.shard_group.get()).wait();
    for (size_t i = 0; i < u.params.size(); ++i) {
      auto& p = u.params[i];
      p.set_data(u.layout.view(full, i, p.sizes()));
    }
  }
}

FullyShardedModel::FullParams::FullParams(FullParams&& other) noexcept
    : state_(std::move(other.state_)),
      writeback_(other.writeback_),
      uncaught_(other.uncaught_) {}

FullyShardedModel::FullParams::~FullParams() noexcept(false) {
  if (!state_) {
    return;
  }
  auto& st = *state_;
  // A load that failed half-way must not reach the shards.
  const bool writeback = writeback_ && std::uncaught_exceptions() == uncaught_;
  at::NoGradGuard no_grad;
  for (auto& u : st.units) {
    if (u.numel() == 0) {
      continue;
    }
    for (size_t i = 0; i < u.params.size(); ++i) {
      auto& p = u.params[i];
      if (writeback && u.layout.ranges[i].len > 0) {
        // This rank's range of the (possibly edited) full value.
        u.layout.piece(u.shard_data, i)
            .copy_(u.layout.piece_of_param(p.detach().reshape({-1}), i));
      }
      p.set_data(u.views[i]);
    }
  }
  st.summoned = false;
  st.install_grad_hooks(); // a dtype change under set_data drops them
  if (writeback) {
    st.placement->refresh_param_shards();
    st.refresh_gathered();
  }
}

} // namespace zero
} // namespace colossalai
