#include <colossalai/nn/optimizer/hybrid_adam.h>

#include <colossalai/utils/compat.h>

#include "cpu_adam_kernel.h"
#include "state_offload.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <torch/optim/serialize.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <unordered_map>

namespace colossalai {
namespace nn {
namespace optimizer {

// ------------------------------------------------------------- options ---

HybridAdamOptions::HybridAdamOptions(double lr) : lr_(lr) {}

bool operator==(const HybridAdamOptions& lhs, const HybridAdamOptions& rhs) {
  return lhs.lr() == rhs.lr() &&
      lhs.bias_correction() == rhs.bias_correction() &&
      lhs.betas() == rhs.betas() && lhs.eps() == rhs.eps() &&
      lhs.weight_decay() == rhs.weight_decay() &&
      lhs.adamw_mode() == rhs.adamw_mode() &&
      lhs.nvme_offload_fraction() == rhs.nvme_offload_fraction() &&
      lhs.nvme_offload_dir() == rhs.nvme_offload_dir();
}

void HybridAdamOptions::serialize(
    torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adamw_mode);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nvme_offload_fraction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nvme_offload_dir);
}

void HybridAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adamw_mode);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, nvme_offload_fraction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(std::string, nvme_offload_dir);
}

double HybridAdamOptions::get_lr() const {
  return lr();
}

void HybridAdamOptions::set_lr(const double lr) {
  this->lr(lr);
}

bool operator==(
    const HybridAdamParamState& lhs,
    const HybridAdamParamState& rhs) {
  auto same = [](const torch::Tensor& a, const torch::Tensor& b) {
    return a.defined() == b.defined() && (!a.defined() || torch::equal(a, b));
  };
  return lhs.step() == rhs.step() && same(lhs.exp_avg(), rhs.exp_avg()) &&
      same(lhs.exp_avg_sq(), rhs.exp_avg_sq());
}

void HybridAdamParamState::serialize(
    torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
}

void HybridAdamParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
}

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

// A parameter's offload bookkeeping.
struct Record {
  bool offload = false;
  int64_t numel = 0;
  std::string exp_avg_path;
  std::string exp_avg_sq_path;
  // The files hold the current states.
  bool on_disk = false;
};

struct CpuItem {
  torch::Tensor param;   // contiguous fp32: the parameter or a copy of it
  torch::Tensor target;  // the parameter, when `param` is a copy
  torch::Tensor grad;    // contiguous
  torch::Tensor working; // undefined: none
  HybridAdamParamState* state = nullptr;
  Record* record = nullptr;
  detail::AdamScalars scalars;
};

// A state tensor as the kernel needs it: contiguous fp32 on the CPU.
torch::Tensor as_kernel_state(const torch::Tensor& t, int64_t numel) {
  TORCH_CHECK(
      t.numel() == numel,
      "HybridAdam: a state has ",
      t.numel(),
      " elements, its parameter ",
      numel);
  if (t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous()) {
    return t;
  }
  return t.to(at::kCPU, at::kFloat).contiguous();
}

void run_cpu_item(const CpuItem& it, float* exp_avg, float* exp_avg_sq) {
  detail::AdamBuffers b;
  b.param = it.param.data_ptr<float>();
  b.grad = it.grad.data_ptr();
  b.grad_dtype = it.grad.scalar_type();
  b.exp_avg = exp_avg;
  b.exp_avg_sq = exp_avg_sq;
  if (it.working.defined()) {
    b.copy = it.working.data_ptr();
    b.copy_dtype = it.working.scalar_type();
  }
  b.numel = it.param.numel();
  detail::adam_update(b, it.scalars);
  if (it.target.defined()) {
    it.target.copy_(it.param.view(it.target.sizes()));
  }
}

#ifdef COLOSSALAI_WITH_CUDA
struct DeviceItem {
  torch::Tensor param;
  torch::Tensor grad; // fp32
  torch::Tensor working;
  HybridAdamParamState* state = nullptr;
  detail::AdamScalars scalars;
};

// GPU parameters: the same arithmetic as the CPU kernel as multi-tensor
// (_foreach) ATen ops, with per-parameter constants as scalar lists.
void device_update(std::vector<DeviceItem>& items) {
  if (items.empty()) {
    return;
  }
  std::vector<torch::Tensor> ps, gs, ms, vs;
  std::vector<at::Scalar> b1, omb1, b2, omb2, eps, sbc2, step, decay;
  for (auto& it : items) {
    if (it.scalars.l2 != 0.f) {
      it.grad = it.grad.add(it.param, it.scalars.l2);
    }
    ps.push_back(it.param);
    gs.push_back(it.grad);
    ms.push_back(it.state->exp_avg());
    vs.push_back(it.state->exp_avg_sq());
    b1.emplace_back(it.scalars.beta1);
    omb1.emplace_back(it.scalars.one_minus_beta1);
    b2.emplace_back(it.scalars.beta2);
    omb2.emplace_back(it.scalars.one_minus_beta2);
    eps.emplace_back(it.scalars.eps);
    sbc2.emplace_back(it.scalars.sqrt_bias_correction2);
    step.emplace_back(it.scalars.neg_step_size);
    decay.emplace_back(it.scalars.decay);
  }
  at::_foreach_mul_(ps, decay);
  at::_foreach_mul_(ms, b1);
  at::_foreach_add_(ms, at::_foreach_mul(gs, omb1));
  at::_foreach_mul_(vs, b2);
  at::_foreach_addcmul_(vs, gs, gs, omb2);
  auto denom = at::_foreach_sqrt(vs);
  at::_foreach_div_(denom, sbc2);
  at::_foreach_add_(denom, eps);
  at::_foreach_addcdiv_(ps, ms, denom, step);
  for (auto& it : items) {
    if (it.working.defined()) {
      it.working.view(-1).copy_(it.param.reshape(-1));
    }
  }
}
#endif

} // namespace

struct HybridAdam::Impl {
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> working;

  double fraction = 0;
  std::string dir; // this optimizer's own subdirectory
  int64_t offloaded_numel = 0;
  int64_t next_file = 0;
  std::unordered_map<const c10::TensorImpl*, Record> records;
  std::unique_ptr<detail::SerialWorker> worker;
  // Three buffers: the parameter being updated, the next one being read,
  // the previous one being written back.
  std::array<torch::Tensor, 3> slot_exp_avg;
  std::array<torch::Tensor, 3> slot_exp_avg_sq;

  ~Impl() {
    worker.reset(); // finishes pending writes before the files go
    if (!dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }

  // Decides, once per parameter, whether its states live in files: the
  // first parameters that fit in the offload share, as ColossalAI does.
  Record& record_for(const torch::Tensor& p, int64_t total_numel) {
    auto [it, inserted] = records.try_emplace(p.unsafeGetTensorImpl());
    Record& r = it->second;
    if (inserted) {
      r.numel = p.numel();
      const auto budget =
          static_cast<int64_t>(static_cast<double>(total_numel) * fraction);
      if (fraction > 0 && p.is_cpu() && offloaded_numel + r.numel <= budget) {
        r.offload = true;
        offloaded_numel += r.numel;
        const auto stem =
            (std::filesystem::path(dir) / std::to_string(next_file++)).string();
        r.exp_avg_path = stem + ".exp_avg.bin";
        r.exp_avg_sq_path = stem + ".exp_avg_sq.bin";
      }
    }
    return r;
  }

  void run_offloaded(std::vector<CpuItem>& items, std::vector<CpuItem>& rest);
};

// Streams the offloaded parameters' states through the three slots while
// `rest` (the in-memory parameters) is updated during the first reads.
void HybridAdam::Impl::run_offloaded(
    std::vector<CpuItem>& items,
    std::vector<CpuItem>& rest) {
  const size_t n = items.size();
  if (n == 0) {
    for (auto& it : rest) {
      run_cpu_item(
          it,
          it.state->exp_avg().data_ptr<float>(),
          it.state->exp_avg_sq().data_ptr<float>());
    }
    return;
  }
  if (!worker) {
    worker = std::make_unique<detail::SerialWorker>();
  }
  int64_t max_numel = 0;
  for (auto& it : items) {
    max_numel = std::max(max_numel, it.record->numel);
  }
  for (size_t k = 0; k < 3; ++k) {
    if (!slot_exp_avg[k].defined() || slot_exp_avg[k].numel() < max_numel) {
      // Jobs still queued hold their own reference to an old buffer.
      slot_exp_avg[k] = at::empty({max_numel}, at::kFloat);
      slot_exp_avg_sq[k] = at::empty({max_numel}, at::kFloat);
    }
  }

  struct Buffers {
    torch::Tensor exp_avg;
    torch::Tensor exp_avg_sq;
    bool from_state = false; // the state's own in-memory tensors
  };
  std::vector<Buffers> bufs(n);
  std::vector<std::future<void>> loads(n);
  std::vector<std::future<void>> writes;
  writes.reserve(n);
  // Jobs only hold copies, but a step must not return (or unwind) while
  // its jobs still run: the next one would race with them.
  auto drain = c10::make_scope_exit([&] {
    for (auto& f : loads) {
      if (f.valid()) {
        f.wait();
      }
    }
    for (auto& f : writes) {
      if (f.valid()) {
        f.wait();
      }
    }
  });

  auto submit_load = [&](size_t j) {
    const CpuItem& it = items[j];
    const Record& r = *it.record;
    if (it.state->exp_avg().defined() && it.state->exp_avg_sq().defined()) {
      // Loaded or fetched into memory since the last step: use as is, then
      // write out and release.
      bufs[j] = {
          as_kernel_state(it.state->exp_avg(), r.numel),
          as_kernel_state(it.state->exp_avg_sq(), r.numel),
          true};
      return;
    }
    const size_t k = j % 3;
    auto m = slot_exp_avg[k].narrow(0, 0, r.numel);
    auto v = slot_exp_avg_sq[k].narrow(0, 0, r.numel);
    bufs[j] = {m, v, false};
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    if (r.on_disk) {
      loads[j] = worker->submit(
          [m, v, bytes, pm = r.exp_avg_path, pv = r.exp_avg_sq_path] {
            detail::read_state_file(pm, m.data_ptr(), bytes);
            detail::read_state_file(pv, v.data_ptr(), bytes);
          });
    } else {
      loads[j] = worker->submit([m, v, bytes] {
        std::memset(m.data_ptr(), 0, bytes);
        std::memset(v.data_ptr(), 0, bytes);
      });
    }
  };

  submit_load(0);
  if (n > 1) {
    submit_load(1);
  }
  for (auto& it : rest) {
    run_cpu_item(
        it,
        it.state->exp_avg().data_ptr<float>(),
        it.state->exp_avg_sq().data_ptr<float>());
  }
  for (size_t j = 0; j < n; ++j) {
    if (loads[j].valid()) {
      loads[j].get();
    }
    run_cpu_item(
        items[j],
        bufs[j].exp_avg.data_ptr<float>(),
        bufs[j].exp_avg_sq.data_ptr<float>());
    const Record& r = *items[j].record;
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    // Submitted before the read that reuses this slot (j + 3), so the
    // worker's order keeps the two apart.
    writes.push_back(worker->submit([m = bufs[j].exp_avg,
                                     v = bufs[j].exp_avg_sq,
                                     bytes,
                                     pm = r.exp_avg_path,
                                     pv = r.exp_avg_sq_path] {
      detail::write_state_file(pm, m.data_ptr(), bytes);
      detail::write_state_file(pv, v.data_ptr(), bytes);
    }));
    if (j + 2 < n) {
      submit_load(j + 2);
    }
  }
  for (auto& f : writes) {
    f.get();
  }
  for (size_t j = 0; j < n; ++j) {
    items[j].record->on_disk = true;
    if (bufs[j].from_state) {
      items[j].state->exp_avg(torch::Tensor());
      items[j].state->exp_avg_sq(torch::Tensor());
    }
  }
}

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

torch::Tensor HybridAdam::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }

  int64_t total_numel = 0;
  if (impl_->fraction > 0) {
    for (const auto& group : param_groups_) {
      for (const auto& p : group.params()) {
        total_numel += p.numel();
      }
    }
  }

  std::vector<CpuItem> resident;
  std::vector<CpuItem> offloaded;
#ifdef COLOSSALAI_WITH_CUDA
  std::vector<DeviceItem> device_items;
#endif
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const auto* options =
        dynamic_cast<const HybridAdamOptions*>(&group.options());
    TORCH_CHECK(
        options != nullptr,
        group_where(gi),
        "options must be HybridAdamOptions");
    check_options(*options, group_where(gi));
    for (auto& p : group.params()) {
      torch::Tensor grad = p.grad();
      if (!grad.defined()) {
        continue;
      }
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

      Record* record = on_cpu ? &impl_->record_for(p, total_numel) : nullptr;
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

      torch::Tensor working;
      auto w = impl_->working.find(p.unsafeGetTensorImpl());
      if (w != impl_->working.end()) {
        working = w->second;
      }

#ifdef COLOSSALAI_WITH_CUDA
      if (!on_cpu) {
        DeviceItem it;
        it.param = p;
        it.grad = grad.to(at::kFloat);
        it.working = working;
        it.state = &state;
        it.scalars = make_scalars(*options, state.step());
        device_items.push_back(std::move(it));
        continue;
      }
#endif
      CpuItem it;
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
        offloaded.push_back(std::move(it));
      } else {
        state.exp_avg(as_kernel_state(state.exp_avg(), p.numel()));
        state.exp_avg_sq(as_kernel_state(state.exp_avg_sq(), p.numel()));
        resident.push_back(std::move(it));
      }
    }
  }
  impl_->run_offloaded(offloaded, resident);
#ifdef COLOSSALAI_WITH_CUDA
  device_update(device_items);
#endif
  return loss;
}

namespace {

// Reads offloaded states that are only on disk into their param states;
// returns those it filled.
std::vector<HybridAdamParamState*> fetch_states(
    const std::vector<torch::optim::OptimizerParamGroup>& groups,
    decltype(std::declval<torch::optim::Optimizer&>().state())& state,
    const std::unordered_map<const c10::TensorImpl*, Record>& records) {
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

void HybridAdam::save(torch::serialize::OutputArchive& archive) const {
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
  // Loaded states are in memory; the next step writes offloaded ones out.
  torch::optim::serialize<HybridAdamParamState, HybridAdamOptions>(
      archive, *this);
}

void HybridAdam::fetch_offloaded_states() {
  fetch_states(param_groups_, state_, impl_->records);
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
