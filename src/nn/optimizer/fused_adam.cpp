// FusedAdam / FusedAdamW: LibTorch's Adam / AdamW state and options, stepped
// by ATen's fused multi-tensor kernels (compat::fused_adam_).

#include <colossalai/nn/optimizer/fused_adam.h>

#include <colossalai/kernels/adamw.h>
#include <colossalai/utils/compat.h>

#include <torch/autograd.h>

#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {
namespace {

// The tensors of one fused call: one device, one dtype, one group's options.
struct Bucket {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  std::vector<int64_t> steps;
};

// Whether every parameter with a gradient can take the fused kernel.
bool fusable(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      const auto& g = p.grad();
      if (!g.defined()) {
        continue;
      }
      // The kernel walks dense storage and one dtype per call.
      if (g.is_sparse() || g.scalar_type() != p.scalar_type() ||
          !p.is_contiguous() || !g.is_contiguous() ||
          g.device() != p.device() || !compat::has_fused_adam(p.device()) ||
          !at::isFloatingType(p.scalar_type())) {
        return false;
      }
    }
  }
  return true;
}

// Whether the defined tensors of `ts` share one dtype.
bool one_dtype(const std::vector<at::Tensor>& ts) {
  c10::optional<at::ScalarType> seen;
  for (const auto& t : ts) {
    if (t.defined()) {
      if (seen.has_value() && *seen != t.scalar_type()) {
        return false;
      }
      seen = t.scalar_type();
    }
  }
  return true;
}

at::Tensor step_tensor(const std::vector<int64_t>& steps, at::Device device) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  bool uniform = true;
  for (auto s : steps) {
    uniform = uniform && s == steps.front();
  }
  if (uniform) { // a fill on the device: no host-to-device copy
    return at::full(
        {static_cast<int64_t>(steps.size())},
        static_cast<double>(steps.front()),
        opts);
  }
  std::vector<float> host(steps.begin(), steps.end());
  return at::tensor(host, at::TensorOptions().dtype(at::kFloat)).to(device);
}

using Copies =
    std::unordered_map<const void*, std::pair<at::Tensor, at::Tensor>>;

// The working copy of `p`, or an undefined tensor.
at::Tensor copy_of(const Copies* copies, const at::Tensor& p) {
  if (copies == nullptr) {
    return at::Tensor();
  }
  auto it = copies->find(p.unsafeGetTensorImpl());
  return it == copies->end() ? at::Tensor() : it->second.second;
}

void write_copy(const at::Tensor& copy, const at::Tensor& p) {
  if (copy.defined()) {
    copy.view({-1}).copy_(p.reshape({-1}));
  }
}

// Adam and AdamW keep the same state fields under different types.
template <class Options, class State, class Base>
torch::Tensor fused_step(
    Base& opt,
    typename Base::LossClosure closure,
    bool decoupled,
    const Copies* copies = nullptr) {
  if (!fusable(opt.param_groups())) {
    auto loss = opt.Base::step(std::move(closure));
    torch::NoGradGuard no_grad;
    for (auto& group : opt.param_groups()) {
      for (auto& p : group.params()) {
        if (p.grad().defined()) {
          write_copy(copy_of(copies, p), p);
        }
      }
    }
    return loss;
  }
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  auto& state = opt.state();
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    std::map<std::pair<std::string, at::ScalarType>, Bucket> buckets;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      const auto key =
          compat::optimizer_state_key<std::remove_reference_t<decltype(state)>>(p);
      auto found = state.find(key);
      if (found == state.end()) {
        auto fresh = std::make_unique<State>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) {
          fresh->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        }
        found = state.emplace(key, std::move(fresh)).first;
      }
      auto& s = static_cast<State&>(*found->second);
      s.step(s.step() + 1);
      auto& b = buckets[{p.device().str(), p.scalar_type()}];
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.exp_avgs.push_back(s.exp_avg());
      b.exp_avg_sqs.push_back(s.exp_avg_sq());
      if (o.amsgrad()) {
        b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      }
      b.steps.push_back(s.step());
    }
    for (auto& [where, b] : buckets) {
      std::vector<at::Tensor> working;
      bool any_copy = false;
      for (const auto& p : b.params) {
        working.push_back(copy_of(copies, p));
        any_copy = any_copy || working.back().defined();
      }
      // Masters with copies: one pass writes both (on a GPU), where the
      // copies share one dtype (the kernel's one working dtype).
      if (any_copy && decoupled && !o.amsgrad() &&
          where.second == at::kFloat && one_dtype(working) &&
          kernels::adamw_step_fused_applies(b.params, b.grads, working)) {
        kernels::adamw_step_(
            b.params,
            b.grads,
            b.exp_avgs,
            b.exp_avg_sqs,
            working,
            b.steps,
            kernels::AdamWStepOptions()
                .lr(o.lr())
                .beta1(std::get<0>(o.betas()))
                .beta2(std::get<1>(o.betas()))
                .eps(o.eps())
                .weight_decay(o.weight_decay()));
        continue;
      }
      const auto steps = step_tensor(b.steps, b.params.front().device());
      compat::fused_adam_(
          b.params,
          b.grads,
          b.exp_avgs,
          b.exp_avg_sqs,
          b.max_exp_avg_sqs,
          steps.unbind(0),
          o.lr(),
          std::get<0>(o.betas()),
          std::get<1>(o.betas()),
          o.weight_decay(),
          o.eps(),
          o.amsgrad(),
          decoupled);
      for (size_t i = 0; i < working.size(); ++i) {
        write_copy(working[i], b.params[i]);
      }
    }
  }
  return loss;
}

} // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  return fused_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      static_cast<torch::optim::AdamW&>(*this),
      std::move(closure),
      true,
      &copies_);
}

void FusedAdamW::set_working_copy(const at::Tensor& param, at::Tensor copy) {
  bool mine = false;
  for (const auto& group : param_groups()) {
    for (const auto& p : group.params()) {
      mine = mine || p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl();
    }
  }
  TORCH_CHECK(
      mine,
      "FusedAdamW::set_working_copy: the tensor is not one of this "
      "optimizer's parameters");
  TORCH_CHECK(
      param.scalar_type() == at::kFloat && copy.defined() &&
          copy.numel() == param.numel() && copy.is_contiguous() &&
          copy.device() == param.device() &&
          (copy.scalar_type() == at::kFloat ||
           copy.scalar_type() == at::kHalf ||
           copy.scalar_type() == at::kBFloat16),
      "FusedAdamW::set_working_copy: the parameter must be float32 and its "
      "copy a contiguous float32, float16 or bfloat16 tensor of its ",
      param.numel(),
      " elements on ",
      param.device());
  copies_[param.unsafeGetTensorImpl()] = {param, std::move(copy)};
}

torch::Tensor FusedAdam::step(LossClosure closure) {
  return fused_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      static_cast<torch::optim::Adam&>(*this), std::move(closure), false);
}

} // namespace optimizer
} // namespace nn
} // namespace colossalai
