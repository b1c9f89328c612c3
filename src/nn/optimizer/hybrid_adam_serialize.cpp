// HybridAdam's save/load, and reading offloaded states back into memory
// (fetch_offloaded_states).

#include "hybrid_adam_internal.h"

#include <colossalai/utils/compat.h>

#include <ATen/ATen.h>
#include <c10/util/ScopeExit.h>
#include <torch/optim/serialize.h>

#include <unordered_map>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {

namespace {

// Reads offloaded states that are only on disk into their param states;
// returns those it filled.
std::vector<HybridAdamParamState*> fetch_states(
    const std::vector<torch::optim::OptimizerParamGroup>& groups,
    decltype(std::declval<torch::optim::Optimizer&>().state())& state,
    const std::unordered_map<const c10::TensorImpl*, detail::Record>& records) {
  std::vector<HybridAdamParamState*> filled;
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      auto r = records.find(p.unsafeGetTensorImpl());
      if (r == records.end() || !r->second.offload || !r->second.on_disk) {
        continue;
      }
      auto s = state.find(
          compat::optimizer_state_key<std::remove_reference_t<decltype(state)>>(
              p));
      if (s == state.end()) {
        continue;
      }
      auto& st = static_cast<HybridAdamParamState&>(*s->second);
      if (st.exp_avg().defined()) {
        continue;
      }
      const size_t bytes = static_cast<size_t>(p.numel()) * sizeof(float);
      auto m = at::empty(p.sizes(), at::kFloat);
      auto v = at::empty(p.sizes(), at::kFloat);
      detail::read_state_file(r->second.exp_avg_path, m.data_ptr(), bytes);
      detail::read_state_file(r->second.exp_avg_sq_path, v.data_ptr(), bytes);
      st.exp_avg(m);
      st.exp_avg_sq(v);
      filled.push_back(&st);
    }
  }
  return filled;
}

} // namespace

namespace {

void check_not_mid_step(const HybridAdam& optimizer, const char* what) {
  TORCH_CHECK(
      !optimizer.stepped_ahead(),
      "HybridAdam::",
      what,
      ": between step_ahead and step(), some parameters' states already "
      "hold the coming step (a plugin's overlap_host_step takes them during "
      "the backward): call it after step()");
}

} // namespace

void HybridAdam::save(torch::serialize::OutputArchive& archive) const {
  check_not_mid_step(*this, "save");
  // The archive gets the offloaded states too; they are read for the
  // duration of the save and dropped again (the files stay current).
  auto& self = const_cast<HybridAdam&>(*this);
  auto filled = fetch_states(param_groups_, self.state_, impl_->records);
  auto release = c10::make_scope_exit([&] {
    for (auto* st : filled) {
      st->exp_avg(torch::Tensor());
      st->exp_avg_sq(torch::Tensor());
    }
  });
  torch::optim::serialize<HybridAdamParamState, HybridAdamOptions>(
      archive, *this);
}

void HybridAdam::load(torch::serialize::InputArchive& archive) {
  check_not_mid_step(*this, "load");
  // Loaded states are in memory; the next step writes offloaded ones out.
  torch::optim::serialize<HybridAdamParamState, HybridAdamOptions>(
      archive, *this);
}

void HybridAdam::fetch_offloaded_states() {
  fetch_states(param_groups_, state_, impl_->records);
}

} // namespace optimizer
} // namespace nn
} // namespace colossalai
