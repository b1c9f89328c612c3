#include <colossalai/nn/optimizer/hybrid_adam.h>

#include <colossalai/kernels/adamw.h>
#include <colossalai/utils/compat.h>

#include "hybrid_adam_internal.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <unordered_map>

namespace colossalai {
namespace nn {
namespace optimizer {

// ------------------------------------------------------------ internals ---

namespace {

void check_options(const HybridAdamOptions& o, const std::string& where) {
  TORCH_CHECK(o.lr() >= 0, where, "lr must be >= 0, got ", o.lr());
  TORCH_CHECK(o.eps() >= 0, where, "eps must be >= 0, got ", o.eps());
  const double b1 = std::get<0>(o.betas());
  const double b2 = std::get<1>(o.betas());
  TORCH_CHECK(b1 >= 0 && b1 < 1, where, "betas[0] must be in [0, 1), got ", b1);
  TORCH_CHECK(b2 >= 0 && b2 < 1, where, "betas[1] must be in [0, 1), got ", b2);
  TORCH_CHECK(
      o.weight_decay() >= 0,
      where,
      "weight_decay must be >= 0, got ",
      o.weight_decay());
  const double f = o.nvme_offload_fraction();
  TORCH_CHECK(
      f >= 0 && f <= 1,
      where,
      "nvme_offload_fraction must be in [0, 1], got ",
      f);
}

std::string group_where(size_t index) {
  return "HybridAdam: parameter group " + std::to_string(index) + ": ";
}

// Each parameter's constants, rounded to fp32 where LibTorch's Adam/AdamW
// round them (a double Scalar applied to a float tensor).
detail::AdamScalars make_scalars(const HybridAdamOptions& o, int64_t step) {
  const double b1 = std::get<0>(o.betas());
  const double b2 = std::get<1>(o.betas());
  double bc1 = 1;
  double bc2 = 1;
  if (o.bias_correction()) {
    bc1 = 1 - std::pow(b1, step);
    bc2 = 1 - std::pow(b2, step);
  }
  const double wd = o.weight_decay();
  detail::AdamScalars s;
  s.beta1 = static_cast<float>(b1);
  s.one_minus_beta1 = static_cast<float>(1 - b1);
  s.beta2 = static_cast<float>(b2);
  s.one_minus_beta2 = static_cast<float>(1 - b2);
  s.eps = static_cast<float>(o.eps());
  s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bc2));
  s.neg_step_size = static_cast<float>(-(o.lr() / bc1));
  s.decay = static_cast<float>(o.adamw_mode() && wd != 0 ? 1 - o.lr() * wd : 1);
  s.l2 = static_cast<float>(!o.adamw_mode() ? wd : 0);
  return s;
}

} // namespace

// ------------------------------------------------------------ optimizer ---

namespace {

// Each group's own options, as given.
std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> own_options(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> out;
  for (const auto& g : groups) {
    out.push_back(g.has_options() ? g.options().clone() : nullptr);
  }
  return out;
}

} // namespace

HybridAdam::HybridAdam(
    std::vector<torch::optim::OptimizerParamGroup> param_groups,
    HybridAdamOptions defaults)
    // By reference: the groups are read for their options before the
    // delegated constructor moves them.
    : HybridAdam(own_options(param_groups), param_groups, std::move(defaults)) {
}

HybridAdam::HybridAdam(
    std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> own,
    std::vector<torch::optim::OptimizerParamGroup>& param_groups,
    HybridAdamOptions defaults)
    : Optimizer(
          std::move(param_groups),
          std::make_unique<HybridAdamOptions>(defaults)),
      impl_(std::make_unique<Impl>()) {
  // Later 2.x releases replace a group's options by the defaults merged
  // with those of the optimizers LibTorch knows, which drops
  // HybridAdamOptions (and would hide options of a wrong type): keep each
  // group's own, as 1.13 does.
  for (size_t i = 0; i < own.size() && i < param_groups_.size(); ++i) {
    if (own[i]) {
      param_groups_[i].set_options(std::move(own[i]));
    }
  }
  check_options(defaults, "HybridAdam: ");
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto* o =
        dynamic_cast<const HybridAdamOptions*>(&param_groups_[i].options());
    TORCH_CHECK(
        o != nullptr, group_where(i), "options must be HybridAdamOptions");
    check_options(*o, group_where(i));
    TORCH_CHECK(
        o->nvme_offload_fraction() == defaults.nvme_offload_fraction() &&
            o->nvme_offload_dir() == defaults.nvme_offload_dir(),
        group_where(i),
        "nvme_offload_fraction and nvme_offload_dir apply to the whole "
        "optimizer; set them in the defaults only (group has ",
        o->nvme_offload_fraction(),
        " and '",
        o->nvme_offload_dir(),
        "')");
  }
  impl_->fraction = defaults.nvme_offload_fraction();
  if (impl_->fraction > 0) {
    impl_->dir = detail::make_offload_dir(
        defaults.nvme_offload_dir(), "HybridAdam: nvme_offload_dir");
  }
}

HybridAdam::HybridAdam(
    std::vector<torch::Tensor> params,
    HybridAdamOptions defaults)
    : HybridAdam(
          {torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(defaults)) {}

HybridAdam::~HybridAdam() = default;
HybridAdam::HybridAdam(HybridAdam&&) = default;

void HybridAdam::add_item(
    size_t gi,
    const torch::Tensor& p,
    int64_t total_numel,
    bool counted,
    Items& items) {
  const auto& group = param_groups_[gi];
  const auto* options = dynamic_cast<const HybridAdamOptions*>(&group.options());
  const torch::Tensor& grad = p.grad();
  TORCH_CHECK(
      !grad.is_sparse(), "HybridAdam does not support sparse gradients");
  TORCH_CHECK(
      grad.numel() == p.numel() && grad.device() == p.device(),
      "HybridAdam: a gradient (",
      grad.numel(),
      " elements on ",
      grad.device(),
      ") does not match its parameter (",
      p.numel(),
      " elements on ",
      p.device(),
      ")");
  TORCH_CHECK(
      p.scalar_type() == at::kFloat,
      "HybridAdam: parameters must be fp32 (the master copy), got ",
      p.scalar_type(),
      "; keep bf16/fp16 weights as working copies (set_working_copy)");
  const auto gt = grad.scalar_type();
  TORCH_CHECK(
      gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf,
      "HybridAdam: gradients must be fp32, bf16 or fp16, got ",
      gt);
  const bool on_cpu = p.is_cpu();
#ifndef COLOSSALAI_WITH_CUDA
  TORCH_CHECK(
      on_cpu,
      "HybridAdam: parameter on ",
      p.device(),
      "; this build updates CPU parameters only");
#endif

  detail::Record* record =
      on_cpu ? &impl_->record_for(p, total_numel) : nullptr;
  const bool offload = record != nullptr && record->offload;
  const auto key = compat::optimizer_state_key<
      std::remove_reference_t<decltype(state_)>>(p);
  auto found = state_.find(key);
  if (found == state_.end()) {
    auto fresh = std::make_unique<HybridAdamParamState>();
    fresh->step(0);
    found = state_.emplace(key, std::move(fresh)).first;
    if (offload) {
      record->on_disk = false; // no files yet: start from zeros
    }
  }
  auto& state = static_cast<HybridAdamParamState&>(*found->second);
  if (!offload && !state.exp_avg().defined()) {
    state.exp_avg(torch::zeros_like(p, at::MemoryFormat::Contiguous));
    state.exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Contiguous));
  }
  state.step(state.step() + 1);
  if (counted) {
    impl_->stepped.push_back(p);
  }

  torch::Tensor working;
  auto w = impl_->working.find(p.unsafeGetTensorImpl());
  if (w != impl_->working.end()) {
    working = w->second;
  }

#ifdef COLOSSALAI_WITH_CUDA
  if (!on_cpu) {
    detail::DeviceItem it;
    it.param = p;
    it.grad = grad; // 16-bit ones converted as the update goes
    it.working = working;
    it.state = &state;
    it.scalars = make_scalars(*options, state.step());
    it.options = options;
    items.device.push_back(std::move(it));
    return;
  }
#endif
  detail::CpuItem it;
  if (p.is_contiguous()) {
    it.param = p;
  } else {
    it.param = p.contiguous();
    it.target = p;
  }
  it.grad = grad.contiguous();
  it.working = working;
  it.state = &state;
  it.record = record;
  it.scalars = make_scalars(*options, state.step());
  if (offload) {
    items.offloaded.push_back(std::move(it));
  } else {
    state.exp_avg(detail::as_kernel_state(state.exp_avg(), p.numel()));
    state.exp_avg_sq(detail::as_kernel_state(state.exp_avg_sq(), p.numel()));
    items.resident.push_back(std::move(it));
  }
}

int64_t HybridAdam::total_numel() const {
  int64_t n = 0;
  if (impl_->fraction > 0) {
    for (const auto& group : param_groups_) {
      for (const auto& p : group.params()) {
        n += p.numel();
      }
    }
  }
  return n;
}

const HybridAdamOptions& HybridAdam::checked_options(size_t gi) const {
  const auto* options =
      dynamic_cast<const HybridAdamOptions*>(&param_groups_[gi].options());
  TORCH_CHECK(
      options != nullptr, group_where(gi), "options must be HybridAdamOptions");
  check_options(*options, group_where(gi));
  return *options;
}

torch::Tensor HybridAdam::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  // Updates queued ahead (NOTE [Host steps overlap the backward]) are part
  // of this step: they finish first, with this step's options.
  auto ahead = std::move(impl_->ahead);
  auto ahead_options = std::move(impl_->ahead_options);
  impl_->ahead.clear();
  impl_->ahead_options.clear();
  wait_ahead();
  for (const auto& kv : ahead_options) {
    TORCH_CHECK(
        kv.first < param_groups_.size() &&
            checked_options(kv.first) == *kv.second,
        group_where(kv.first),
        "its options (lr, betas, eps, weight_decay, ...) changed between "
        "the backward and step(), after some of its host parameters were "
        "updated ahead with the old ones (step_ahead; a plugin's "
        "overlap_host_step): set them before the backward");
  }
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // A loss scaler's verdict for this step only (SkipsStepOnDevice). On
  // the host it is read here, for free, and a skipped step advances
  // nothing.
  const torch::Tensor found_inf = std::move(impl_->found_inf);
  impl_->found_inf = torch::Tensor();
  impl_->stepped.clear();
  TORCH_CHECK(
      !found_inf.defined() || ahead.empty(),
      "HybridAdam: a loss scaler's verdict for a step whose host parameters "
      "were partly updated ahead (step_ahead): a step that may be skipped "
      "cannot be taken ahead");
  if (found_inf.defined() && found_inf.is_cpu() &&
      *found_inf.to(at::kFloat).data_ptr<float>() != 0.0f) {
    return loss;
  }

  const int64_t numel = total_numel();
  Items items;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    checked_options(gi);
    for (auto& p : param_groups_[gi].params()) {
      if (p.grad().defined() && ahead.count(p.unsafeGetTensorImpl()) == 0) {
        add_item(gi, p, numel, found_inf.defined(), items);
      }
    }
  }
  // The device's update first: it only enqueues kernels, which then run
  // while the host updates its parameters (offloaded masters' steps no
  // longer leave the device idle).
#ifdef COLOSSALAI_WITH_CUDA
  detail::device_update(items.device, found_inf);
#endif
  // Host parameters beside a verdict on a device (skips_step_on_device
  // said no): read it.
  if (found_inf.defined() && !found_inf.is_cpu() &&
      (!items.offloaded.empty() || !items.resident.empty()) &&
      found_inf.item<float>() != 0.0f) {
    return loss;
  }
  impl_->run_offloaded(items.offloaded, items.resident);
  return loss;
}

size_t HybridAdam::step_ahead(
    const std::vector<torch::Tensor>& params,
    std::function<void()> ready,
    std::function<void()> then) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(
      !impl_->found_inf.defined(),
      "HybridAdam::step_ahead: the coming step carries a loss scaler's "
      "verdict (skip_step_if); a step that may be skipped cannot be taken "
      "ahead");
  std::unordered_map<const c10::TensorImpl*, size_t> group_of;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    for (const auto& p : param_groups_[gi].params()) {
      group_of.emplace(p.unsafeGetTensorImpl(), gi);
    }
  }
  const int64_t numel = total_numel();
  std::vector<std::pair<size_t, torch::Tensor>> taken;
  for (const auto& p : params) {
    const auto it = group_of.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(
        it != group_of.end(),
        "HybridAdam::step_ahead: not a parameter of this optimizer");
    TORCH_CHECK(
        impl_->ahead.count(p.unsafeGetTensorImpl()) == 0,
        "HybridAdam::step_ahead: a parameter was already updated ahead of "
        "this step (a second backward before step()?)");
    if (!p.grad().defined()) {
      continue; // not part of any step
    }
    // All or nothing: a GPU's parameter, one without states yet, or one
    // whose states are kept in files leaves the whole call to step(). The
    // first step creates the states (on the stepping thread, not the
    // backward's) and decides which go to files, in group order (the first
    // that fit, as ColossalAI chooses them).
    if (!p.is_cpu() ||
        state_.count(compat::optimizer_state_key<
                     std::remove_reference_t<decltype(state_)>>(p)) == 0) {
      return 0;
    }
    const auto record = impl_->records.find(p.unsafeGetTensorImpl());
    if (record == impl_->records.end() ? impl_->fraction > 0
                                       : record->second.offload) {
      return 0;
    }
    taken.emplace_back(it->second, p);
  }
  Items items;
  for (const auto& [gi, p] : taken) {
    const auto& options = checked_options(gi);
    if (impl_->ahead_options.count(gi) == 0) {
      impl_->ahead_options.emplace(
          gi, std::make_unique<HybridAdamOptions>(options));
    }
    impl_->ahead.insert(p.unsafeGetTensorImpl());
    add_item(gi, p, numel, /*counted=*/false, items);
  }
  if (items.resident.empty()) {
    return 0;
  }
  if (!impl_->ahead_worker) {
    impl_->ahead_worker = std::make_unique<detail::SerialWorker>();
  }
  const size_t n = items.resident.size();
  impl_->ahead_jobs.push_back(impl_->ahead_worker->submit(
      [resident = std::move(items.resident),
       ready = std::move(ready),
       then = std::move(then)] {
        if (ready) {
          ready();
        }
        for (const auto& it : resident) {
          detail::run_cpu_item(
              it,
              it.state->exp_avg().data_ptr<float>(),
              it.state->exp_avg_sq().data_ptr<float>(),
              nullptr);
        }
        if (then) {
          then();
        }
      }));
  return n;
}

void HybridAdam::wait_ahead() {
  auto jobs = std::move(impl_->ahead_jobs);
  impl_->ahead_jobs.clear();
  std::exception_ptr failed;
  for (auto& f : jobs) {
    try {
      f.get(); // every job, even after a failure: none may outlive the step
    } catch (...) {
      if (!failed) {
        failed = std::current_exception();
      }
    }
  }
  if (failed) {
    std::rethrow_exception(failed);
  }
}

bool HybridAdam::stepped_ahead() const {
  return !impl_->ahead.empty();
}

void HybridAdam::drop_ahead() {
  const auto forget = c10::make_scope_exit([this] {
    impl_->ahead.clear();
    impl_->ahead_options.clear();
  });
  wait_ahead();
}

bool HybridAdam::skips_step_on_device() const {
  c10::optional<at::Device> device;
  for (const auto& group : param_groups_) {
    const auto* o = dynamic_cast<const HybridAdamOptions*>(&group.options());
    for (const auto& p : group.params()) {
      const auto& g = p.grad();
      if (!g.defined()) {
        continue;
      }
      if (o == nullptr || (device.has_value() && *device != p.device())) {
        return false;
      }
      device = p.device();
      if (p.is_cpu()) {
        continue;
      }
      // The device's kernels that read the verdict there: the AdamW
      // kernel, ATen's fused Adam (detail::device_update's first two).
      const bool dense = o->bias_correction() && p.is_contiguous() &&
          g.is_contiguous() && p.scalar_type() == at::kFloat;
      const bool kernel = o->adamw_mode() &&
          kernels::adamw_step_fused_applies({p}, {g}, {});
      if (!dense || !(kernel || compat::has_fused_adam(p.device()))) {
        return false;
      }
    }
  }
  return device.has_value();
}

void HybridAdam::skip_step_if(at::Tensor found_inf) {
  impl_->found_inf = std::move(found_inf);
}

void HybridAdam::undo_step_counts() {
  for (const auto& p : impl_->stepped) {
    auto found = state_.find(compat::optimizer_state_key<
                             std::remove_reference_t<decltype(state_)>>(p));
    if (found != state_.end()) {
      auto& s = static_cast<HybridAdamParamState&>(*found->second);
      s.step(std::max<int64_t>(s.step() - 1, 0));
    }
  }
  impl_->stepped.clear();
}

void HybridAdam::set_host_step_hook(
    std::function<void(const torch::Tensor&)> hook) {
  impl_->host_step_hook = std::move(hook);
}

void HybridAdam::set_working_copy(
    const torch::Tensor& param,
    torch::Tensor working) {
  TORCH_CHECK(
      param.defined() && working.defined(),
      "set_working_copy: tensors must be defined");
  TORCH_CHECK(
      working.numel() == param.numel(),
      "set_working_copy: working copy has ",
      working.numel(),
      " elements, the parameter ",
      param.numel());
  TORCH_CHECK(
      working.device() == param.device(),
      "set_working_copy: working copy is on ",
      working.device(),
      ", the parameter on ",
      param.device());
  TORCH_CHECK(
      working.is_contiguous(), "set_working_copy: working must be contiguous");
  const auto t = working.scalar_type();
  TORCH_CHECK(
      t == at::kBFloat16 || t == at::kHalf || t == at::kFloat,
      "set_working_copy: working copy must be bf16, fp16 or fp32, got ",
      t);
  bool known = false;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      known = known || p.is_same(param);
    }
  }
  TORCH_CHECK(known, "set_working_copy: not a parameter of this optimizer");
  impl_->working[param.unsafeGetTensorImpl()] = std::move(working);
}

void HybridAdam::remove_working_copy(const torch::Tensor& param) {
  impl_->working.erase(param.unsafeGetTensorImpl());
}

torch::Tensor HybridAdam::working_copy(const torch::Tensor& param) const {
  auto it = impl_->working.find(param.unsafeGetTensorImpl());
  return it == impl_->working.end() ? torch::Tensor() : it->second;
}

bool HybridAdam::is_offloaded(const torch::Tensor& param) const {
  auto it = impl_->records.find(param.unsafeGetTensorImpl());
  return it != impl_->records.end() && it->second.offload;
}

std::vector<std::string> HybridAdam::offload_files(
    const torch::Tensor& param) const {
  auto it = impl_->records.find(param.unsafeGetTensorImpl());
  if (it == impl_->records.end() || !it->second.offload) {
    return {};
  }
  return {it->second.exp_avg_path, it->second.exp_avg_sq_path};
}

int64_t HybridAdam::offloaded_numel() const {
  return impl_->offloaded_numel;
}

std::string HybridAdam::offload_dir() const {
  return impl_->dir;
}

} // namespace optimizer
} // namespace nn
} // namespace colossalai
