// FusedAdam / FusedAdamW: LibTorch's Adam / AdamW state and options, stepped
// by ATen's fused multi-tensor kernels (compat::fused_adam_).

#include <colossalai/nn/optimizer/fused_adam.h>

#include <colossalai/kernels/adamw.h>
#include <colossalai/utils/compat.h>

#include "grad_slices.h"

#include <torch/autograd.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {
namespace detail {

// The tensors of one fused call: one device, one dtype, one group's options.
struct Bucket {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  std::vector<int64_t> steps;
};

} // namespace detail

namespace {

using detail::Bucket;

// Whether `g` may step `p` in a fused call: its dtype, or a 16-bit
// gradient of a float32 master (NOTE [Gradient shards in bf16]).
bool grad_dtype_fits(const at::Tensor& g, const at::Tensor& p) {
  const auto t = g.scalar_type();
  return t == p.scalar_type() ||
      (p.scalar_type() == at::kFloat && (t == at::kBFloat16 || t == at::kHalf));
}

// Whether every parameter with a gradient can take the fused kernel.
bool fusable(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      const auto& g = p.grad();
      if (!g.defined()) {
        continue;
      }
      // The kernel walks dense storage and one dtype per call.
      if (g.is_sparse() || !grad_dtype_fits(g, p) || !p.is_contiguous() ||
          !g.is_contiguous() || g.device() != p.device() ||
          !compat::has_fused_adam(p.device()) ||
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
//
// `skip`: the verdict of a step skipped on the device, for this step only
// (SkipsStepOnDevice); the parameters stepped are recorded there.
template <class Options, class State, class Base>
torch::Tensor fused_step(
    Base& opt,
    typename Base::LossClosure closure,
    bool decoupled,
    detail::DeviceSkip& skip,
    const Copies* copies = nullptr) {
  const at::Tensor found_inf = std::move(skip.found_inf);
  skip.found_inf = at::Tensor();
  skip.stepped.clear();
  if (!fusable(opt.param_groups())) {
    // No kernel to skip on the device (the caller asked without
    // skips_step_on_device): the verdict is read here.
    if (found_inf.defined() && found_inf.item<double>() != 0) {
      return torch::Tensor();
    }
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
    // By device, parameter dtype and gradient dtype.
    std::map<std::tuple<std::string, at::ScalarType, at::ScalarType>, Bucket>
        buckets;
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
      auto& b =
          buckets[{p.device().str(), p.scalar_type(), p.grad().scalar_type()}];
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.exp_avgs.push_back(s.exp_avg());
      b.exp_avg_sqs.push_back(s.exp_avg_sq());
      if (o.amsgrad()) {
        b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      }
      b.steps.push_back(s.step());
      if (found_inf.defined()) {
        skip.stepped.push_back(p);
      }
    }
    for (auto& [where, b] : buckets) {
      std::vector<at::Tensor> working;
      bool any_copy = false;
      for (const auto& p : b.params) {
        working.push_back(copy_of(copies, p));
        any_copy = any_copy || working.back().defined();
      }
      // Masters with copies: one pass writes both (on a GPU), where the
      // copies share one dtype (the kernel's one working dtype); it reads
      // 16-bit gradients as they are.
      if (any_copy && decoupled && !o.amsgrad() &&
          std::get<1>(where) == at::kFloat && one_dtype(working) &&
          kernels::adamw_step_fused_applies(b.params, b.grads, working)) {
        kernels::adamw_step_(
            b.params,
            b.grads,
            b.exp_avgs,
            b.exp_avg_sqs,
            working,
            b.steps,
            detail::adamw_kernel_options(o),
            found_inf);
        continue;
      }
      detail::fused_adam_in_slices(
          b.params,
          b.grads,
          b.exp_avgs,
          b.exp_avg_sqs,
          b.max_exp_avg_sqs,
          step_tensor(b.steps, b.params.front().device()).unbind(0),
          o.lr(),
          std::get<0>(o.betas()),
          std::get<1>(o.betas()),
          o.weight_decay(),
          o.eps(),
          o.amsgrad(),
          decoupled,
          found_inf);
      // A skipped step's copies are of masters it left as they were.
      for (size_t i = 0; i < working.size(); ++i) {
        write_copy(working[i], b.params[i]);
      }
    }
  }
  return loss;
}

} // namespace

namespace detail {

// NOTE [Captured optimizer steps]: what a fused optimizer keeps in graph
// mode. Each call is one fused launch of the captured step (a group's
// tensors of one device and dtype, as an ordinary step buckets them), with
// the device buffers its launch reads and the host rewrites before each
// replay: the kernel's table (masters with copies on a GPU), or ATen's step
// counts and learning rate. set_graph_mode(true) plans the calls from the
// parameters with state and allocates those buffers, before the capture:
// memory a capture allocates may be handed to another of its kernels,
// which would write over the host's values at every replay. The first step
// in graph mode binds the gradients the captured backward made.
struct FusedGraph {
  struct Call {
    size_t group = 0;
    Bucket tensors; // grads bound by the first step in graph mode
    std::vector<at::Tensor> working;
    bool use_kernel = false; // kernels::AdamWStepGraph, else ATen's kernel
    std::unique_ptr<kernels::AdamWStepGraph> kernel;
    at::Tensor table; // the kernel's scalars
    at::Tensor steps; // float32 [n]: each tensor's step count
    at::Tensor lr;    // float32 []: the group's learning rate
    // The captured launch's arguments (ATen's kernel takes them by value).
    double beta1 = 0, beta2 = 0, weight_decay = 0, eps = 0;
    bool amsgrad = false, decoupled = true;
  };
  bool on = false;
  bool bound = false;
  std::vector<Call> calls;
};

} // namespace detail

namespace {

// Why `opt`'s steps cannot be captured; empty where they can.
template <class Base>
std::string graph_blocker(const Base& opt, const char* name) {
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      if (!compat::has_fused_adam_tensor_lr(p.device()) ||
          !at::isFloatingType(p.scalar_type())) {
        std::ostringstream os;
        os << name << " has no fused kernel reading the learning rate from "
           << "device memory (LibTorch 2.2+) for a " << p.scalar_type()
           << " parameter on " << p.device()
           << " in this LibTorch, and its unfused step computes each "
              "step's scalars on the host";
        return os.str();
      }
    }
  }
  return std::string();
}

template <class State, class Base>
State* state_of(Base& opt, const at::Tensor& p) {
  auto& state = opt.state();
  auto found = state.find(
      compat::optimizer_state_key<std::remove_reference_t<decltype(state)>>(p));
  return found == state.end() ? nullptr : static_cast<State*>(found->second.get());
}

// The calls of every captured step: each parameter with state (those an
// ordinary step has updated), bucketed as an ordinary step buckets them,
// with the buffers their launches read. Launches nothing.
template <class Options, class State, class Base>
void graph_plan(
    Base& opt,
    detail::FusedGraph& graph,
    bool decoupled,
    const Copies* copies) {
  auto& groups = opt.param_groups();
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& o = static_cast<const Options&>(groups[gi].options());
    std::map<std::pair<std::string, at::ScalarType>, Bucket> buckets;
    for (auto& p : groups[gi].params()) {
      const auto* s = state_of<State>(opt, p);
      if (s == nullptr) {
        continue;
      }
      auto& b = buckets[{p.device().str(), p.scalar_type()}];
      b.params.push_back(p);
      b.exp_avgs.push_back(s->exp_avg());
      b.exp_avg_sqs.push_back(s->exp_avg_sq());
      if (o.amsgrad()) {
        b.max_exp_avg_sqs.push_back(s->max_exp_avg_sq());
      }
    }
    for (auto& entry : buckets) {
      const auto& where = entry.first;
      auto& b = entry.second;
      detail::FusedGraph::Call call;
      call.group = gi;
      call.amsgrad = o.amsgrad();
      call.decoupled = decoupled;
      bool any_copy = false;
      for (const auto& p : b.params) {
        call.working.push_back(copy_of(copies, p));
        any_copy = any_copy || call.working.back().defined();
      }
      call.beta1 = std::get<0>(o.betas());
      call.beta2 = std::get<1>(o.betas());
      call.weight_decay = o.weight_decay();
      call.eps = o.eps();
      // The same choice as an ordinary step's (whose gradients share their
      // parameters' device), so both update alike.
      call.use_kernel = any_copy && decoupled && !o.amsgrad() &&
          where.second == at::kFloat && one_dtype(call.working) &&
          kernels::adamw_step_fused_applies(b.params, {}, call.working);
      const auto device = b.params.front().device();
      if (call.use_kernel) {
        call.table = at::empty(
            {kernels::AdamWStepGraph::table_bytes(b.params)},
            at::TensorOptions().dtype(at::kByte).device(device));
      } else {
        const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
        call.steps = at::empty({static_cast<int64_t>(b.params.size())}, f32);
        call.lr = at::empty({}, f32);
      }
      call.tensors = std::move(b);
      graph.calls.push_back(std::move(call));
    }
  }
}

// The first step in graph mode: the gradients of the planned parameters,
// exactly those (a captured step updates a fixed set).
template <class Base>
void graph_bind(Base& opt, detail::FusedGraph& graph, const char* name) {
  TORCH_CHECK(
      fusable(opt.param_groups()),
      name,
      ": a gradient cannot take the fused kernel (sparse, strided, on "
      "another device than its parameter or of a dtype the kernel does not "
      "read), so this step cannot be captured");
  std::unordered_map<const void*, bool> planned;
  for (const auto& call : graph.calls) {
    for (const auto& p : call.tensors.params) {
      planned.emplace(p.unsafeGetTensorImpl(), true);
    }
  }
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      TORCH_CHECK(
          !p.grad().defined() || planned.count(p.unsafeGetTensorImpl()),
          name,
          ": a parameter (shape ",
          p.sizes(),
          ") has a gradient but had no optimizer state when graph mode began; "
          "run ordinary steps until every trained parameter has state "
          "(GraphedStep's warm-up steps do)");
    }
  }
  for (auto& call : graph.calls) {
    auto& b = call.tensors;
    b.grads.clear();
    for (const auto& p : b.params) {
      TORCH_CHECK(
          p.grad().defined(),
          name,
          ": a parameter (shape ",
          p.sizes(),
          ") with optimizer state has no gradient in the captured step; a "
          "captured step updates the same parameters every time");
      // The AdamW kernel reads one gradient dtype per launch.
      TORCH_CHECK(
          !call.use_kernel || b.grads.empty() ||
              p.grad().scalar_type() == b.grads.front().scalar_type(),
          name,
          ": the captured launch reads one gradient dtype; gradients are ",
          b.grads.empty() ? p.grad().scalar_type()
                          : b.grads.front().scalar_type(),
          " and ",
          p.grad().scalar_type());
      b.grads.push_back(p.grad());
    }
    if (call.use_kernel) {
      call.kernel = std::make_unique<kernels::AdamWStepGraph>(
          b.params,
          b.grads,
          b.exp_avgs,
          b.exp_avg_sqs,
          call.working,
          kernels::AdamWStepOptions()
              .beta1(call.beta1)
              .beta2(call.beta2)
              .eps(call.eps)
              .weight_decay(call.weight_decay),
          call.table);
    }
  }
  graph.bound = true;
}

// The device's half: what a capture records and a replay repeats.
// `found_inf`: a loss scaler's verdict (SkipsStepOnDevice), whose address
// a capture records.
void graph_launch(detail::FusedGraph& graph, const at::Tensor& found_inf) {
  torch::NoGradGuard no_grad;
  for (auto& call : graph.calls) {
    if (call.kernel) {
      call.kernel->launch(found_inf);
      continue;
    }
    const auto& b = call.tensors;
    // 16-bit gradients of float32 masters: the conversions are captured
    // too, into memory of the capture's pool.
    detail::fused_adam_in_slices(
        b.params,
        b.grads,
        b.exp_avgs,
        b.exp_avg_sqs,
        b.max_exp_avg_sqs,
        call.steps.unbind(0),
        call.lr,
        call.beta1,
        call.beta2,
        call.weight_decay,
        call.eps,
        call.amsgrad,
        call.decoupled,
        found_inf);
    for (size_t i = 0; i < call.working.size(); ++i) {
      write_copy(call.working[i], b.params[i]);
    }
  }
}

// The host's half of a replayed step (NOTE [Captured optimizer steps]).
// Every check comes before the first write: a refused step advances
// nothing.
template <class Options, class State, class Base>
void graph_prepare(Base& opt, detail::FusedGraph& graph, const char* name) {
  TORCH_CHECK(
      graph.on && graph.bound,
      name,
      ": prepare_graph_step needs graph mode and a captured step");
  auto& groups = opt.param_groups();
  for (const auto& call : graph.calls) {
    TORCH_CHECK(
        call.group < groups.size(),
        name,
        ": a parameter group was removed after the capture");
    const auto& o = static_cast<const Options&>(groups[call.group].options());
    // The kernel's table carries the weight decay; ATen's launch holds it.
    TORCH_CHECK(
        std::get<0>(o.betas()) == call.beta1 &&
            std::get<1>(o.betas()) == call.beta2 && o.eps() == call.eps &&
            (call.kernel || o.weight_decay() == call.weight_decay),
        name,
        ": betas, eps",
        call.kernel ? "" : " and weight_decay",
        " are the captured launch's arguments; changing them needs a new "
        "capture (the learning rate may change)");
    const auto& b = call.tensors;
    for (size_t i = 0; i < b.params.size(); ++i) {
      const auto* s = state_of<State>(opt, b.params[i]);
      // A state loaded after the capture holds other tensors than the
      // ones the graph updates.
      TORCH_CHECK(
          s != nullptr && s->exp_avg().is_same(b.exp_avgs[i]) &&
              s->exp_avg_sq().is_same(b.exp_avg_sqs[i]) &&
              (!call.amsgrad || s->max_exp_avg_sq().is_same(b.max_exp_avg_sqs[i])),
          name,
          ": a captured parameter's state was replaced after the capture (a "
          "state dict loaded, say); that needs a new capture");
    }
  }
  for (auto& call : graph.calls) {
    const auto& o = static_cast<const Options&>(groups[call.group].options());
    std::vector<int64_t> steps;
    for (const auto& p : call.tensors.params) {
      auto* s = state_of<State>(opt, p);
      s->step(s->step() + 1);
      steps.push_back(s->step());
    }
    if (call.kernel) {
      call.kernel->upload(
          steps,
          kernels::AdamWStepOptions()
              .lr(o.lr())
              .beta1(call.beta1)
              .beta2(call.beta2)
              .eps(call.eps)
              .weight_decay(o.weight_decay()));
      continue;
    }
    call.lr.fill_(o.lr());
    if (std::all_of(steps.begin(), steps.end(), [&](int64_t s) {
          return s == steps.front();
        })) {
      call.steps.fill_(static_cast<double>(steps.front()));
    } else { // from pinned memory: no wait on the host
      auto host = at::tensor(std::vector<float>(steps.begin(), steps.end()));
      call.steps.copy_(
          call.steps.is_cuda() ? host.pin_memory() : host, /*non_blocking=*/true);
    }
  }
}

// A step in graph mode. The first one binds the gradients; outside a
// capture it is an ordinary step (its scalars written as
// prepare_graph_step writes them), inside one nothing runs, so nothing
// advances. Later ones launch the device's half with the scalars of the
// last prepare_graph_step: what a replay does.
//
// `skip`: a verdict for this step (SkipsStepOnDevice); a capture records
// its tensor. A replay's counts are the host's half's (undo_counts).
template <class Options, class State, class Base>
void graph_step(
    Base& opt,
    detail::FusedGraph& graph,
    const char* name,
    detail::DeviceSkip& skip) {
  const at::Tensor found_inf = std::move(skip.found_inf);
  skip.found_inf = at::Tensor();
  skip.stepped.clear();
  if (!graph.bound) {
    graph_bind(opt, graph, name);
    if (graph.calls.empty()) {
      return; // no state, no gradients: nothing to step
    }
    if (!compat::stream_capturing(graph.calls.front().tensors.params.front().device())) {
      graph_prepare<Options, State>(opt, graph, name);
    }
  }
  graph_launch(graph, found_inf);
}

// Takes back the step counts the last step skipped on the device advanced
// (SkipsStepOnDevice::undo_step_counts); once.
// In graph mode, every planned parameter's: the host's half advanced them
// all for the step (or replay) whose verdict came.
template <class State, class Base>
void undo_counts(
    Base& opt,
    detail::DeviceSkip& skip,
    const std::shared_ptr<detail::FusedGraph>& graph) {
  if (graph && graph->on && graph->bound) {
    for (const auto& call : graph->calls) {
      for (const auto& p : call.tensors.params) {
        if (auto* s = state_of<State>(opt, p); s != nullptr && s->step() > 0) {
          s->step(s->step() - 1);
        }
      }
    }
    return;
  }
  for (const auto& p : skip.stepped) {
    if (auto* s = state_of<State>(opt, p); s != nullptr && s->step() > 0) {
      s->step(s->step() - 1);
    }
  }
  skip.stepped.clear();
}

template <class Options, class State, class Base>
void set_mode(
    Base& opt,
    std::shared_ptr<detail::FusedGraph>& graph,
    bool on,
    bool decoupled,
    const Copies* copies) {
  graph = std::make_shared<detail::FusedGraph>(); // a new plan each time
  graph->on = on;
  if (on) {
    graph_plan<Options, State>(opt, *graph, decoupled, copies);
  }
}

} // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  if (graph_ && graph_->on) {
    TORCH_CHECK(closure == nullptr, "FusedAdamW: no closure in graph mode");
    graph_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
        static_cast<torch::optim::AdamW&>(*this), *graph_, "FusedAdamW", skip_);
    return torch::Tensor();
  }
  return fused_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      static_cast<torch::optim::AdamW&>(*this),
      std::move(closure),
      true,
      skip_,
      &copies_);
}

bool FusedAdamW::skips_step_on_device() const {
  return fusable(param_groups());
}

void FusedAdamW::skip_step_if(at::Tensor found_inf) {
  skip_.found_inf = std::move(found_inf);
}

void FusedAdamW::undo_step_counts() {
  undo_counts<torch::optim::AdamWParamState>(
      static_cast<torch::optim::AdamW&>(*this), skip_, graph_);
}

std::string FusedAdamW::graph_capture_blocker() const {
  return graph_blocker(
      static_cast<const torch::optim::AdamW&>(*this), "FusedAdamW");
}

void FusedAdamW::set_graph_mode(bool on) {
  set_mode<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      static_cast<torch::optim::AdamW&>(*this), graph_, on, true, &copies_);
}

void FusedAdamW::prepare_graph_step() {
  TORCH_CHECK(graph_, "FusedAdamW: prepare_graph_step outside graph mode");
  graph_prepare<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      static_cast<torch::optim::AdamW&>(*this), *graph_, "FusedAdamW");
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
  if (graph_ && graph_->on) {
    TORCH_CHECK(closure == nullptr, "FusedAdam: no closure in graph mode");
    graph_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(
        static_cast<torch::optim::Adam&>(*this), *graph_, "FusedAdam", skip_);
    return torch::Tensor();
  }
  return fused_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      static_cast<torch::optim::Adam&>(*this), std::move(closure), false, skip_);
}

bool FusedAdam::skips_step_on_device() const {
  return fusable(param_groups());
}

void FusedAdam::skip_step_if(at::Tensor found_inf) {
  skip_.found_inf = std::move(found_inf);
}

void FusedAdam::undo_step_counts() {
  undo_counts<torch::optim::AdamParamState>(
      static_cast<torch::optim::Adam&>(*this), skip_, graph_);
}

std::string FusedAdam::graph_capture_blocker() const {
  return graph_blocker(
      static_cast<const torch::optim::Adam&>(*this), "FusedAdam");
}

void FusedAdam::set_graph_mode(bool on) {
  set_mode<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      static_cast<torch::optim::Adam&>(*this), graph_, on, false, nullptr);
}

void FusedAdam::prepare_graph_step() {
  TORCH_CHECK(graph_, "FusedAdam: prepare_graph_step outside graph mode");
  graph_prepare<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      static_cast<torch::optim::Adam&>(*this), *graph_, "FusedAdam");
}

} // namespace optimizer
} // namespace nn
} // namespace colossalai
