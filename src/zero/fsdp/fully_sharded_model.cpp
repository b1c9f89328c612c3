#include "state.h"

#include <colossalai/lazy/lazy_init.h>

#include "../gemini/chunk_plan.h"
#include "../../utils/host_memory.h"

#include <colossalai/initialize.h>
#include <colossalai/nn/hookable_module.h>
#include <colossalai/utils/compat.h>
#include <colossalai/utils/env.h>

#include <torch/nn/module.h>

#include <exception>
#include <limits>
#include <map>
#include <regex>
#include <set>

namespace colossalai {
namespace zero {

using detail::all_gather_flat;
using detail::FlatShardLayout;
using detail::FsdpState;
using detail::Unit;

AutoWrapPolicy size_based_wrap_policy(int64_t min_num_params) {
  return [min_num_params](
             const std::string&, torch::nn::Module& m, int64_t numel) {
    return numel >= min_num_params &&
        dynamic_cast<nn::HookableModule*>(&m) != nullptr;
  };
}

AutoWrapPolicy name_wrap_policy(const std::string& pattern) {
  std::regex re(pattern);
  return [re](const std::string& name, torch::nn::Module&, int64_t) {
    return std::regex_match(name, re);
  };
}

namespace {

void check_float_dtype(at::ScalarType t, const char* option) {
  TORCH_CHECK(
      t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
      "FSDP: ",
      option,
      " must be float32, bfloat16 or float16, got ",
      t);
}

// Forward hooks of one scope's module.
class ScopeHooks : public nn::ForwardHooks {
 public:
  ScopeHooks(std::weak_ptr<FsdpState> state, size_t s)
      : state_(std::move(state)), k_(s) {}
  void pre_forward() override {
    state()->enter_scope(k_);
  }
  at::Tensor post_forward(const at::Tensor& output) override {
    return state()->exit_scope(k_, output);
  }

 private:
  std::shared_ptr<FsdpState> state() {
    auto s = state_.lock();
    TORCH_CHECK(s != nullptr, "FSDP: the sharded model was destroyed");
    return s;
  }
  std::weak_ptr<FsdpState> state_;
  size_t k_;
};

int64_t numel_of(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) {
    n += p.numel();
  }
  return n;
}

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
    const int me = dp->rank();
    std::vector<int> shard_ranks, replica_ranks;
    for (int i = 0; i < h; ++i) {
      shard_ranks.push_back(dp->global_rank(me / h * h + i));
    }
    for (int j = 0; j < world / h; ++j) {
      replica_ranks.push_back(dp->global_rank(j * h + me % h));
    }
    st.S = h;
    st.R = world / h;
    st.shard_group = h > 1
        ? distributed::new_group(
              shard_ranks, "fsdp_shard_" + std::to_string(shard_ranks[0]))
        : nullptr;
    st.replicate_group = st.R > 1
        ? distributed::new_group(
              replica_ranks,
              "fsdp_replicate_" + std::to_string(replica_ranks[0]))
        : nullptr;
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
// this rank's fp32 shard. A lazy model's unit comes as that shard already
// (`shard32`, filled piece by piece while the model was materialised, NOTE
// [Lazy initialization]; `sizes`: the parameters' shapes), and the full
// parameters are gathered from the shards, so no rank ever holds the whole
// model.
void build_unit(
    FsdpState& st,
    Unit& u,
    at::Tensor shard32 = at::Tensor(),
    const std::vector<std::vector<int64_t>>* sizes = nullptr) {
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
  u.shard_grad = utils::zeros_like_pinned(u.shard_data);

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

} // namespace

namespace detail {

void FsdpState::install_grad_hooks() {
  std::vector<at::Tensor> params;
  for (const auto& e : grad_params) {
    params.push_back(units[e.first].params[e.second]);
  }
  if (bucketer == nullptr) {
    // Units complete in reverse execution order, the same on every rank:
    // reduce each as it completes, at most two in flight (bounds memory).
    distributed::GradBucketerOptions bo;
    bo.ordered = false;
    bo.max_in_flight = 2;
    bucketer = std::make_shared<distributed::GradBucketer>(
        params.size(), std::move(buckets), this, bo);
  }
  size_t bad = 0;
  TORCH_CHECK(
      bucketer->attach_hooks(params, &bad),
      "FSDP: parameter '",
      units[grad_params[bad].first].param_names[grad_params[bad].second],
      "' is not a leaf");
}

} // namespace detail

FullyShardedModel::FullyShardedModel(
    std::shared_ptr<interface::ModelWrapper> inner,
    FullyShardedOptions options)
    : interface::ModelWrapper(std::move(inner)),
      state_(std::make_shared<FsdpState>()) {
  auto& st = *state_;
  st.o = std::move(options);
  check_float_dtype(st.o.param_dtype(), "param_dtype");
  st.param_dtype = st.o.param_dtype();
  st.reduce_dtype = st.o.reduce_dtype().value_or(st.param_dtype);
  check_float_dtype(st.reduce_dtype, "reduce_dtype");
  const auto buffer_dtype = st.o.buffer_dtype().value_or(st.param_dtype);
  check_float_dtype(buffer_dtype, "buffer_dtype");
  st.device = current_device();
  TORCH_CHECK(
      st.param_dtype != at::kHalf || !st.device.is_cpu(),
      "FSDP: param_dtype float16 needs a CUDA device (CPU LibTorch cannot "
      "multiply fp16 matrices); use bfloat16 on CPU");

  auto dp =
      st.o.process_group() ? st.o.process_group() : distributed::world_group();
  make_groups(st, dp);

  auto module = unwrap();
  // A lazy model (NOTE [Lazy initialization]) is materialised below, unit
  // by unit layout, each rank keeping only its pieces.
  const bool lazy_model = lazy::is_lazy(*module);
  TORCH_CHECK(
      !lazy_model || !st.o.param_init_fn(),
      "FSDP: param_init_fn and a model built in a LazyInitContext exclude "
      "each other (materialisation already gives the constructor's values)");
  if (!lazy_model) {
    prepare_module(st, *module, buffer_dtype, *dp, /*params=*/true);
  }

  // Ignored parameters stay outside every unit.
  std::set<const void*> ignored;
  for (const auto& m : st.o.ignored_modules()) {
    TORCH_CHECK(m != nullptr, "FSDP: ignored_modules holds a null module");
    for (const auto& p : m->parameters()) {
      if (ignored.insert(p.unsafeGetTensorImpl()).second) {
        st.ignored_params.push_back(p);
      }
    }
  }

  // Scopes: the root plus what the policy picks, in pre-order.
  st.scopes.emplace_back();
  st.scopes[0].module = module.get();
  std::vector<std::pair<std::string, size_t>> prefixes; // name. -> scope
  if (st.o.auto_wrap_policy()) {
    for (const auto& item : module->named_modules("", false)) {
      auto& m = *item.value();
      if (!st.o.auto_wrap_policy()(item.key(), m, numel_of(m))) {
        continue;
      }
      auto* hookable = dynamic_cast<nn::HookableModule*>(&m);
      TORCH_CHECK(
          hookable != nullptr,
          "FSDP: auto_wrap_policy chose module '",
          item.key(),
          "' (",
          m.name(),
          "), which cannot be a unit: its class must derive from "
          "colossalai::nn::HookableModule and open a ForwardScope in "
          "forward (see colossalai/nn/hookable_module.h)");
      detail::Scope scope;
      scope.name = item.key();
      scope.module = &m;
      prefixes.emplace_back(item.key() + ".", st.scopes.size());
      st.scopes.push_back(std::move(scope));
    }
  }
  // Each parameter belongs to the deepest scope whose name prefixes it.
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<size_t> owners;
  std::set<const void*> seen;
  for (const auto& item : module->named_parameters(true)) {
    const void* impl = item.value().unsafeGetTensorImpl();
    if (ignored.count(impl) || !seen.insert(impl).second) {
      continue;
    }
    size_t owner = 0;
    for (const auto& pre : prefixes) {
      if (item.key().compare(0, pre.first.size(), pre.first) == 0) {
        owner = pre.second;
      }
    }
    params.push_back(item.value());
    names.push_back(item.key());
    owners.push_back(owner);
  }
  if (st.o.param_init_fn()) {
    at::NoGradGuard no_grad;
    for (auto& scope : st.scopes) {
      st.o.param_init_fn()(*scope.module);
    }
  }
  auto add_to_unit = [&](size_t k, size_t i) {
    st.units[k].params.push_back(params[i]);
    st.units[k].param_names.push_back(names[i]);
    auto& su = st.scopes[owners[i]].units;
    if (std::find(su.begin(), su.end(), k) == su.end()) {
      su.push_back(k);
    }
  };
  if (st.o.chunk_size() == 0) {
    // One unit per scope (NOTE [FSDP units]).
    st.units.resize(st.scopes.size());
    for (size_t k = 0; k < st.scopes.size(); ++k) {
      st.units[k].name = st.scopes[k].name;
      st.scopes[k].units = {k};
    }
    for (size_t i = 0; i < params.size(); ++i) {
      st.units[owners[i]].params.push_back(params[i]);
      st.units[owners[i]].param_names.push_back(names[i]);
    }
  } else {
    // Fixed-size chunks in parameter order (NOTE [Gemini chunks]).
    TORCH_CHECK(
        st.o.chunk_size() > 0,
        "FSDP: chunk_size must be >= 0, got ",
        st.o.chunk_size());
    std::vector<int64_t> numels;
    for (const auto& p : params) {
      numels.push_back(p.numel());
    }
    const auto chunks = gemini::pack_chunks(numels, st.o.chunk_size(), st.S);
    st.units.resize(std::max<size_t>(chunks.size(), 1));
    for (size_t c = 0; c < chunks.size(); ++c) {
      st.units[c].name = "chunk" + std::to_string(c);
      for (size_t i : chunks[c].params) {
        add_to_unit(c, i);
      }
    }
  }
  for (size_t k : st.scopes[0].units) {
    st.units[k].root = true; // kept gathered from forward to backward
  }
  st.open_scopes.assign(st.units.size(), 0);
  st.unit_scope.assign(st.units.size(), 0);
  for (size_t s = st.scopes.size(); s-- > 0;) {
    for (size_t k : st.scopes[s].units) {
      st.unit_scope[k] = s; // the earliest scope: the last in backward
    }
  }
  // Tiers (NOTE [Gemini placement]).
  st.placement = std::make_unique<gemini::Placement>(st, st.o.placement());
  st.placement->assign_tiers();
  for (auto& u : st.units) {
    lay_out_unit(st, u);
  }
  // Lazy: one replay of the construction hands each parameter to its unit,
  // whose fp32 shard takes this rank's piece of it; the parameter keeps
  // that piece (a view) until the unit is built.
  std::vector<at::Tensor> shards(st.units.size());
  std::vector<std::vector<std::vector<int64_t>>> sizes(st.units.size());
  if (lazy_model) {
    std::map<std::string, std::pair<size_t, size_t>> where;
    for (size_t k = 0; k < st.units.size(); ++k) {
      auto& u = st.units[k];
      for (size_t i = 0; i < u.params.size(); ++i) {
        where[u.param_names[i]] = {k, i};
        sizes[k].push_back(u.params[i].sizes().vec());
      }
    }
    lazy::materialize(
        *module, [&](const std::string& name, const at::Tensor& full) {
          auto it = where.find(name);
          if (it == where.end()) {
            return full; // a buffer, or an ignored parameter: whole
          }
          const size_t k = it->second.first, i = it->second.second;
          const auto& u = st.units[k];
          if (!shards[k].defined()) {
            shards[k] = at::zeros(
                {u.layout.shard},
                at::TensorOptions(st.device).dtype(at::kFloat));
          }
          const auto& r = u.layout.ranges[i];
          auto piece = u.layout.piece(shards[k], i);
          piece.copy_(full.reshape({-1}).narrow(0, r.in_param, r.len));
          return piece;
        });
    prepare_module(st, *module, buffer_dtype, *dp, /*params=*/false);
  }
  for (size_t k = 0; k < st.units.size(); ++k) {
    auto& u = st.units[k];
    if (lazy_model) {
      if (!shards[k].defined()) { // a unit without parameters
        shards[k] = at::zeros(
            {u.layout.shard}, at::TensorOptions(st.device).dtype(at::kFloat));
      }
      build_unit(st, u, std::move(shards[k]), &sizes[k]);
    } else {
      build_unit(st, u);
    }
  }
  // One bucket per unit (its flat gradient is reduce-scattered at once),
  // from the planner every data-parallel strategy shares.
  std::vector<at::Tensor> trainable;
  distributed::BucketPlanOptions plan;
  plan.cap = std::numeric_limits<int64_t>::max();
  plan.by_dtype_and_device = false;
  for (size_t k = 0; k < st.units.size(); ++k) {
    const auto& u = st.units[k];
    for (size_t i = 0; i < u.params.size(); ++i) {
      if (u.params[i].requires_grad()) {
        st.grad_params.emplace_back(k, i);
        trainable.push_back(u.params[i]);
        plan.groups.push_back(static_cast<int64_t>(k));
      }
    }
  }
  st.buckets = distributed::plan_buckets(trainable, plan);
  for (const auto& bucket : st.buckets) {
    st.bucket_unit.push_back(st.grad_params[bucket.front()].first);
  }
  for (size_t k = 1; k < st.scopes.size(); ++k) {
    dynamic_cast<nn::HookableModule*>(st.scopes[k].module)
        ->set_forward_hooks(std::make_shared<ScopeHooks>(state_, k));
  }
  st.install_grad_hooks();
  st.placement->setup();
  st.sample_peak();
}

FullyShardedModel::~FullyShardedModel() {
  for (size_t k = 1; k < state_->scopes.size(); ++k) {
    if (auto* h = dynamic_cast<nn::HookableModule*>(state_->scopes[k].module)) {
      h->set_forward_hooks(nullptr);
    }
  }
}

at::Tensor FullyShardedModel::transform_input(const at::Tensor& x) {
  return x.is_floating_point() && x.scalar_type() != state_->param_dtype
      ? x.to(state_->param_dtype)
      : x;
}

void FullyShardedModel::pre_forward() {
  state_->root_pre_forward();
}

void FullyShardedModel::post_forward() noexcept {
  try {
    state_->root_post_forward();
  } catch (const std::exception& e) {
    TORCH_WARN("FSDP: releasing parameters after forward failed: ", e.what());
  }
}

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

int64_t FullyShardedModel::prefetch_count() const {
  return state_->prefetches;
}

void FullyShardedModel::set_require_sync(bool require) {
  TORCH_CHECK(
      !state_->in_backward(), "FSDP: no_sync cannot change during backward");
  state_->set_require_sync(require);
}

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
