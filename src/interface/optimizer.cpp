#include <colossalai/interface/optimizer.h>

#include <colossalai/distributed/collectives.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/utils/compat.h>

#include "../distributed/raised_backward.h"

#include <c10/util/Type.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <typeinfo>

namespace colossalai {
namespace interface {

namespace {

// Partly offloaded shards put gradients (and so their norms) on two
// devices: stack them where the first one is.
at::Tensor stack_on_one_device(std::vector<at::Tensor> ts) {
  for (auto& t : ts) {
    t = t.to(ts.front().device());
  }
  return at::stack(ts);
}

} // namespace

OptimizerWrapper::OptimizerWrapper(
    std::shared_ptr<torch::optim::Optimizer> optim)
    : optim_(std::move(optim)) {
  TORCH_CHECK(optim_ != nullptr, "OptimizerWrapper: the optimizer is null");
}

void OptimizerWrapper::step() {
  distributed::detail::guard_step([this] { optim_->step(); });
}

void OptimizerWrapper::zero_grad(bool set_to_none) {
  // Implemented here rather than through Optimizer::zero_grad, whose default
  // differs between LibTorch 1.13 (zeros) and 2.x (drops).
  for (auto& group : optim_->param_groups()) {
    for (auto& p : group.params()) {
      if (!p.mutable_grad().defined()) {
        continue;
      }
      if (set_to_none) {
        p.mutable_grad() = at::Tensor();
      } else {
        p.mutable_grad().detach_();
        p.mutable_grad().zero_();
      }
    }
  }
}

void OptimizerWrapper::backward(const at::Tensor& loss, bool retain_graph) {
  TORCH_CHECK(
      loss.numel() == 1,
      "backward: the loss must be a scalar, got shape ",
      loss.sizes());
  loss.backward({}, retain_graph);
}

std::string OptimizerWrapper::graph_capture_blocker() const {
  if (!graph_refusal_.empty()) {
    return graph_refusal_;
  }
  if (typeid(*this) != typeid(OptimizerWrapper)) {
    return "the optimizer wrapper " + c10::demangle(typeid(*this).name()) +
        " works on the host in its step; a captured step takes the "
        "booster without a plugin (fp32 or bf16) or LowLevelZeroPlugin at "
        "one rank";
  }
  return optimizer_graph_blocker();
}

std::string OptimizerWrapper::optimizer_graph_blocker() const {
  const auto* c =
      dynamic_cast<const nn::optimizer::GraphCapturable*>(optim_.get());
  if (c == nullptr) {
    const auto& o = *optim_;
    return "the optimizer " + c10::demangle(typeid(o).name()) +
        " computes each step's scalars (step counts, bias corrections) on "
        "the host, which a replayed graph would repeat unchanged; use "
        "nn::optimizer::FusedAdamW or FusedAdam";
  }
  return c->graph_capture_blocker();
}

void OptimizerWrapper::set_graph_mode(bool on) {
  auto* c = dynamic_cast<nn::optimizer::GraphCapturable*>(optim_.get());
  TORCH_CHECK(
      c != nullptr || !on,
      "set_graph_mode: ",
      optimizer_graph_blocker());
  if (c != nullptr) {
    c->set_graph_mode(on);
  }
}

void OptimizerWrapper::prepare_graph_step() {
  auto* c = dynamic_cast<nn::optimizer::GraphCapturable*>(optim_.get());
  TORCH_CHECK(c != nullptr, "prepare_graph_step: ", optimizer_graph_blocker());
  c->prepare_graph_step();
}

std::vector<at::Tensor> OptimizerWrapper::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& group : optim_->param_groups()) {
    for (auto& p : group.params()) {
      out.push_back(p);
    }
  }
  return out;
}

double total_norm(
    const std::vector<at::Tensor>& tensors,
    double norm_type,
    const distributed::ProcessGroup* group) {
  if (group == nullptr) {
    return total_norm(
        tensors, norm_type, std::vector<const distributed::ProcessGroup*>{});
  }
  return total_norm(
      tensors, norm_type, std::vector<const distributed::ProcessGroup*>{group});
}

namespace {

// The defined, non-empty tensors, grouped by device in first-seen order.
std::vector<std::vector<at::Tensor>> by_device(
    const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (!t.defined() || t.numel() == 0) {
      continue;
    }
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.front().device() == t.device();
    });
    if (it == groups.end()) {
      groups.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  return groups;
}

// Each defined, non-empty tensor's norm in float32, on its device. A GPU's
// tensors go through the multi-tensor kernel where LibTorch has it (a few
// launches for a whole model instead of one per parameter, as PyTorch's
// clip_grad_norm_ does); the CPU keeps one reduction per tensor.
std::vector<at::Tensor> norms_of(
    const std::vector<at::Tensor>& tensors,
    double norm_type) {
  const bool inf = std::isinf(norm_type);
  std::vector<at::Tensor> norms;
  for (const auto& group : by_device(tensors)) {
    if (group.front().is_cuda()) {
      auto fused = compat::foreach_norms_float(group, norm_type);
      if (!fused.empty()) {
        norms.insert(norms.end(), fused.begin(), fused.end());
        continue;
      }
    }
    for (const auto& g : group) {
      // A 16-bit gradient is read in float32 by the reduction itself, not
      // copied to float32 first.
      norms.push_back(
          inf ? g.abs().max().to(at::kFloat)
              : g.scalar_type() == at::kFloat
              ? g.norm(norm_type)
              : at::linalg_vector_norm(
                    g, norm_type, c10::nullopt, false, at::kFloat));
    }
  }
  return norms;
}

} // namespace

at::Tensor total_norm_tensor(
    const std::vector<at::Tensor>& tensors,
    double norm_type) {
  auto norms = norms_of(tensors, norm_type);
  if (norms.empty()) {
    for (const auto& t : tensors) {
      if (t.defined()) {
        return at::zeros({}, t.options().dtype(at::kFloat));
      }
    }
    return at::zeros({}, at::kFloat);
  }
  auto all = stack_on_one_device(norms);
  return std::isinf(norm_type) ? all.max() : all.norm(norm_type);
}

namespace {

// The partials of total_norm over `groups` (the sum of norm^p in double,
// or the max), reduced over each group in turn on its device: [1].
at::Tensor reduced_partials(
    const std::vector<at::Tensor>& tensors,
    double norm_type,
    const std::vector<const distributed::ProcessGroup*>& groups) {
  const bool inf = std::isinf(norm_type);
  const auto norms = norms_of(tensors, norm_type);
  at::Tensor local;
  if (norms.empty()) {
    // Where a norm would have been: no later copy from pageable memory.
    at::Device device(at::kCPU);
    for (const auto& t : tensors) {
      if (t.defined()) {
        device = t.device();
        break;
      }
    }
    local = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  } else {
    auto all = stack_on_one_device(norms).to(at::kDouble);
    local = (inf ? all.max() : all.pow(norm_type).sum()).reshape({1});
  }
  for (const auto* group : groups) {
    if (group == nullptr || group->size() == 1) {
      continue;
    }
    // On the group's device (NCCL takes no host tensors; offloaded shards
    // live on the host).
    local = local.to(group->device());
    distributed::all_reduce(
        local,
        *group,
        inf ? distributed::ReduceOp::kMax : distributed::ReduceOp::kSum)
        .wait();
  }
  return local;
}

} // namespace

double total_norm(
    const std::vector<at::Tensor>& tensors,
    double norm_type,
    const std::vector<const distributed::ProcessGroup*>& groups) {
  for (const auto& g : tensors) {
    TORCH_CHECK(
        !g.defined() || !compat::stream_capturing(g.device()),
        "the global gradient norm (clip_grad_by_norm) is read back to the "
        "host, which a CUDA graph cannot capture; clip on the device with "
        "clip_grad_by_norm_tensor, or LowLevelZeroPlugin's max_norm at one "
        "rank, or outside the captured step");
  }
  if (groups.empty()) {
    // One host sync for the whole model (the norm is returned as a number).
    return total_norm_tensor(tensors, norm_type).item<double>();
  }
  const double v = reduced_partials(tensors, norm_type, groups).item<double>();
  return std::isinf(norm_type) ? v : std::pow(v, 1.0 / norm_type);
}

at::Tensor total_norm_on_device(
    const std::vector<at::Tensor>& tensors,
    double norm_type,
    const std::vector<const distributed::ProcessGroup*>& groups) {
  if (groups.empty()) {
    return total_norm_tensor(tensors, norm_type).to(at::kDouble);
  }
  auto v = reduced_partials(tensors, norm_type, groups).reshape({});
  return std::isinf(norm_type) ? v : v.pow(1.0 / norm_type);
}

at::Tensor clip_grads_on_device(
    const std::vector<at::Tensor>& grads,
    double max_norm,
    double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
  TORCH_CHECK(norm_type > 0, "clip_grad_by_norm: norm_type must be positive");
  auto norm = total_norm_tensor(grads, norm_type);
  scale_by_clip_coef(grads, norm, max_norm);
  return norm;
}

void scale_by_clip_coef(
    const std::vector<at::Tensor>& grads,
    const at::Tensor& norm,
    double max_norm) {
  const auto coef = at::full({}, max_norm, norm.options())
                        .div(norm + 1e-6)
                        .clamp_max(1.0)
                        .to(at::kFloat);
  // One copy per device (offloaded shards live on the host): not one per
  // tensor, each a read back from the device.
  for (const auto& group : by_device(grads)) {
    const auto device = group.front().device();
    if (device.is_cpu()) {
      // The host reads the coefficient anyway (its step needs the
      // gradients): a pass over them only where it scales.
      const auto host = coef.to(at::kCPU);
      if (host.data_ptr<float>()[0] < 1.0f) {
        compat::foreach_mul_(group, host);
      }
      continue;
    }
    // On a GPU in the gradients' dtype where they share one: the
    // multi-tensor kernel takes only that (torch's clip_grad_norm_ also
    // rounds the coefficient to a 16-bit gradient's dtype there).
    const auto dtype = group.front().scalar_type();
    const bool one_dtype = std::all_of(
        group.begin(), group.end(), [&](const at::Tensor& g) {
          return g.scalar_type() == dtype;
        });
    compat::foreach_mul_(
        group, coef.to(device, one_dtype ? dtype : at::kFloat));
  }
}

double grad_norm(const std::vector<at::Tensor>& params, double norm_type) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    grads.push_back(p.grad());
  }
  return total_norm(grads, norm_type);
}

void scale_grads(const std::vector<at::Tensor>& params, double factor) {
  for (auto& p : params) {
    if (p.grad().defined()) {
      p.mutable_grad().mul_(factor);
    }
  }
}

double OptimizerWrapper::clip_grad_by_norm(double max_norm, double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
  TORCH_CHECK(norm_type > 0, "clip_grad_by_norm: norm_type must be positive");
  auto params = parameters();
  double norm = grad_norm(params, norm_type);
  // Same rule and epsilon as torch.nn.utils.clip_grad_norm_.
  double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    scale_grads(params, coef);
  }
  return norm;
}

at::Tensor OptimizerWrapper::clip_grad_by_norm_tensor(
    double max_norm,
    double norm_type) {
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters()) {
    grads.push_back(p.grad());
  }
  return clip_grads_on_device(grads, max_norm, norm_type);
}

void OptimizerWrapper::clip_grad_by_value(double clip_value) {
  TORCH_CHECK(clip_value >= 0, "clip_grad_by_value: clip_value must be >= 0");
  for (auto& p : parameters()) {
    if (p.grad().defined()) {
      p.mutable_grad().clamp_(-clip_value, clip_value);
    }
  }
}

} // namespace interface
} // namespace colossalai
