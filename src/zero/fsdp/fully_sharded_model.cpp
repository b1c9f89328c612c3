// FullyShardedModel's construction: the auto-wrap policies, wrapping the module
// into scopes and units (with their hooks), and the destructor.

#include "fully_sharded_model_internal.h"

#include <colossalai/lazy/lazy_init.h>

#include "../gemini/chunk_plan.h"

#include <colossalai/initialize.h>
#include <colossalai/nn/hookable_module.h>
#include <colossalai/quantization/fp8.h>

#include <torch/nn/module.h>
#include <torch/version.h>

#include <limits>
#include <map>
#include <regex>
#include <set>

namespace colossalai {
namespace zero {

using detail::build_unit;
using detail::FsdpState;
using detail::lay_out_unit;
using detail::make_groups;
using detail::prepare_module;

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

} // namespace

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
  if (st.o.fp8_communication()) {
    TORCH_CHECK(
        quantization::fp8_supported(),
        "FSDP: fp8_communication needs LibTorch 2.1 or later (its float8 "
        "dtypes); this is ",
        TORCH_VERSION);
    st.fp8_shard = st.S > 1 && quantization::fp8_compresses(*st.shard_group);
    st.fp8_replicate =
        st.R > 1 && quantization::fp8_compresses(*st.replicate_group);
  }

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
} // namespace zero
} // namespace colossalai
