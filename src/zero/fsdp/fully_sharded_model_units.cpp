// Building FullyShardedModel's units: the shard/replicate process groups,
// the module's preparation, and each unit's flat layout and shards.

#include "../common/hybrid_groups.h"
#include "fully_sharded_model_internal.h"

#include "../../utils/host_memory.h"

#include <colossalai/utils/compat.h>
#include <colossalai/utils/env.h>

namespace colossalai {
namespace zero {
namespace detail {

void make_groups(FsdpState& st, const distributed::ProcessGroupPtr& dp) {
  const auto strategy = st.o.sharding_strategy();
  const int world = dp->size();
  if (strategy == ShardingStrategy::kFullShard ||
      strategy == ShardingStrategy::kShardGradOp) {
    st.shard_group = dp;
    st.S = world;
  } else if (strategy == ShardingStrategy::kNoShard) {
    st.S = 1;
    st.R = world;
    st.shard_group = nullptr;
    st.replicate_group = world > 1 ? dp : nullptr;
  } else {
    int h = st.o.hybrid_shard_size();
    if (h == 0) {
      h = utils::read_dist_env().local_world_size.value_or(world);
    }
    TORCH_CHECK(
        h > 0 && world % h == 0,
        "FSDP: hybrid_shard_size (",
        h,
        ") must divide the data-parallel size ",
        world);
    auto groups = hybrid_groups(dp, h, "fsdp");
    st.S = h;
    st.R = world / h;
    st.shard_group = std::move(groups.shards);
    st.replicate_group = std::move(groups.replicas);
  }
}

// The module on the device with its buffers in buffer_dtype, and with
// sync_module_states rank 0's values (parameters too, unless lazy: then
// every rank replays the same construction).
void prepare_module(
    FsdpState& st,
    torch::nn::Module& module,
    at::ScalarType buffer_dtype,
    const distributed::ProcessGroup& dp,
    bool params) {
  module.to(st.device);
  for (auto& b : module.buffers()) {
    if (b.is_floating_point()) {
      b.set_data(b.to(buffer_dtype));
    }
  }
  if (st.o.sync_module_states() && dp.size() > 1) {
    at::NoGradGuard no_grad;
    if (params) {
      for (auto t : module.parameters()) {
        distributed::broadcast(t, 0, dp).wait();
      }
    }
    for (auto t : module.buffers()) {
      distributed::broadcast(t, 0, dp).wait();
    }
  }
}

void lay_out_unit(FsdpState& st, Unit& u) {
  for (size_t i = 0; i < u.params.size(); ++i) {
    TORCH_CHECK(
        u.params[i].is_floating_point(),
        "FSDP: parameter '",
        u.param_names[i],
        "' is not floating point");
  }
  const int r = st.S > 1 ? st.shard_rank() : 0;
  u.layout = FlatShardLayout::of(u.params, st.S, r);
}

// Lays a unit's parameters out flat (NOTE [Flat shard layout]) and keeps
// this rank's fp32 shard and its gradient shard (reduce_dtype where the
// options keep low-precision gradients). A lazy model's unit comes as that
// shard already (`shard32`, filled piece by piece while the model was
// materialised, NOTE [Lazy initialization]; `sizes`: the parameters'
// shapes), and the full parameters are gathered from the shards, so no
// rank ever holds the whole model.
void build_unit(
    FsdpState& st,
    Unit& u,
    at::Tensor shard32,
    const std::vector<std::vector<int64_t>>* sizes) {
  u.aliased = st.S == 1 && st.param_dtype == at::kFloat && !u.offloaded;
  if (!shard32.defined()) {
    auto flat32 = u.layout.flatten(
        u.params, at::TensorOptions(st.device).dtype(at::kFloat));
    if (u.aliased) {
      u.full = flat32;
      u.shard_data = flat32;
    } else {
      auto shard = u.layout.my_shard(flat32).clone();
      u.shard_data =
          u.offloaded ? utils::offload_to_host(shard) : shard.to(st.device);
      u.full = flat32.to(st.param_dtype, false, /*copy=*/true);
    }
  } else if (u.aliased) {
    u.full = shard32;
    u.shard_data = shard32;
  } else {
    u.full = at::empty(
        {u.layout.padded()},
        at::TensorOptions(st.device).dtype(st.param_dtype));
    auto src = shard32.to(st.param_dtype);
    all_gather_flat(u.full, src, u.layout, st.shard_group.get()).wait();
    u.shard_data =
        u.offloaded ? utils::offload_to_host(shard32) : shard32.to(st.device);
  }
  u.shard_grad = utils::zeros_like_pinned(
      u.shard_data,
      st.o.keep_low_precision_grads() ? st.reduce_dtype : at::kFloat);

  at::NoGradGuard no_grad;
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    const auto shape =
        sizes != nullptr ? at::IntArrayRef((*sizes)[i]) : p.sizes();
    u.views.push_back(u.layout.view(u.full, i, shape).detach());
    p.set_data(u.views.back());
  }
  u.make_pieces(); // this rank's part of each parameter, for the optimizer
  u.gathered = true;
  if (st.reshard_at_rest() && !u.aliased && !u.keep_gathered) {
    compat::free_storage(u.full);
    u.gathered = false;
  }
}

} // namespace detail
} // namespace zero
} // namespace colossalai
