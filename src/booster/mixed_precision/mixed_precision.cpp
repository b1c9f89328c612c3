#include <colossalai/booster/mixed_precision/bf16.h>
#include <colossalai/booster/mixed_precision/fp16_torch.h>
#include <colossalai/nn/optimizer/skips_step_on_device.h>
#include <colossalai/utils/compat.h>

#include "../../distributed/raised_backward.h"

namespace colossalai {
namespace booster {
namespace mixed_precision {

AutocastModel::AutocastModel(
    std::shared_ptr<interface::ModelWrapper> inner,
    at::DeviceType device,
    at::ScalarType dtype)
    : interface::ModelWrapper(std::move(inner)),
      device_(device),
      dtype_(dtype) {}

void AutocastModel::pre_forward() {
  guard_.emplace(device_, dtype_);
}

void AutocastModel::post_forward() noexcept {
  guard_.reset();
}

void MixedPrecision::bind_device(at::DeviceType device) {
  if (!device_) {
    device_ = device;
  }
  TORCH_CHECK(
      *device_ == device,
      "mixed_precision '",
      name(),
      "' was built for ",
      c10::DeviceTypeName(*device_, /*lower_case=*/true),
      " but the Booster runs on ",
      c10::DeviceTypeName(device, /*lower_case=*/true),
      ": build it for that device, or leave its device unset");
  TORCH_CHECK(
      name() != "fp16" || device == at::kCUDA,
      "mixed_precision 'fp16' needs a CUDA device: CPU LibTorch cannot "
      "multiply fp16 matrices; use mixed_precision 'bf16' on CPU");
}

void BF16MixedPrecision::configure(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& /*optimizer*/) {
  if (model) {
    TORCH_INTERNAL_ASSERT(device_, "bf16: bind_device before configure");
    model = std::make_shared<AutocastModel>(model, *device_, at::kBFloat16);
  }
}

TorchAMPOptimizer::TorchAMPOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optim,
    amp::GradScalerOptions options)
    : interface::OptimizerWrapper(std::move(optim)), scaler_(options) {}

void TorchAMPOptimizer::backward(const at::Tensor& loss, bool retain_graph) {
  interface::OptimizerWrapper::backward(scaler_.scale(loss), retain_graph);
}

at::Tensor TorchAMPOptimizer::scale_loss(const at::Tensor& loss) {
  return scaler_.scale(loss);
}

namespace {

// The optimizer, where it can skip this step on the device and the
// gradients it would step lie on one device (written to `where`).
nn::optimizer::SkipsStepOnDevice* skipping_on_device(
    torch::optim::Optimizer& optim,
    const std::vector<at::Tensor>& params,
    at::Device* where = nullptr) {
  auto* skipping = dynamic_cast<nn::optimizer::SkipsStepOnDevice*>(&optim);
  if (skipping == nullptr || !skipping->skips_step_on_device()) {
    return nullptr;
  }
  c10::optional<at::Device> device;
  for (const auto& p : params) {
    if (p.grad().defined()) {
      if (device.has_value() && *device != p.grad().device()) {
        return nullptr;
      }
      device = p.grad().device();
    }
  }
  if (!device.has_value()) {
    return nullptr;
  }
  if (where != nullptr) {
    *where = *device;
  }
  return skipping;
}

} // namespace

void TorchAMPOptimizer::step() {
  distributed::detail::guard_step([this] {
    synchronize_step();
    const auto params = parameters();
    at::Device device(at::kCPU);
    if (auto* skipping = skipping_on_device(*optim_, params, &device)) {
      // The verdict stays on the device: the kernel skips there, the scale
      // is updated there, and the host reads it at the next step.
      TORCH_CHECK(
          !compat::stream_capturing(device) || scaler_.scale_lives_on(device),
          "a captured fp16 step needs an eager step first (the loss scale "
          "moves to the device there)");
      const auto found_inf = scaler_.unscale_on_device_(params);
      skipping->skip_step_if(found_inf);
      optim_->step();
      scaler_.update();
      verdict_.record(found_inf);
      return;
    }
    last_step_skipped_ = scaler_.unscale_(params);
    if (!last_step_skipped_) {
      optim_->step();
    }
    scaler_.update();
  });
}

std::string TorchAMPOptimizer::graph_capture_blocker() const {
  if (!graph_refusal().empty()) {
    return graph_refusal();
  }
  if (dynamic_cast<const nn::optimizer::SkipsStepOnDevice*>(optim_.get()) ==
      nullptr) {
    return "fp16 mixed precision reads the overflow verdict on the host "
           "before the step, unless the optimizer skips an overflowing step "
           "on the device (nn::optimizer::FusedAdamW, FusedAdam); or take "
           "mixed_precision bf16";
  }
  return optimizer_graph_blocker();
}

void TorchAMPOptimizer::set_graph_mode(bool on) {
  synchronize_step();
  verdict_.reset_capture();
  interface::OptimizerWrapper::set_graph_mode(on);
}

void TorchAMPOptimizer::prepare_graph_step() {
  synchronize_step();
  interface::OptimizerWrapper::prepare_graph_step();
}

void TorchAMPOptimizer::after_graph_replay() {
  verdict_.after_replay();
}

void TorchAMPOptimizer::synchronize_step() {
  if (const auto skipped = verdict_.settle(*optim_)) {
    last_step_skipped_ = *skipped;
  }
}

double TorchAMPOptimizer::clip_grad_by_norm(double max_norm, double norm_type) {
  if (scaler_.unscale_(parameters())) {
    return std::numeric_limits<double>::infinity(); // step will be skipped
  }
  return interface::OptimizerWrapper::clip_grad_by_norm(max_norm, norm_type);
}

at::Tensor TorchAMPOptimizer::clip_grad_by_norm_tensor(
    double max_norm,
    double norm_type) {
  const auto params = parameters();
  TORCH_CHECK(
      skipping_on_device(*optim_, params) != nullptr,
      "clip_grad_by_norm_tensor: with fp16 the gradients are unscaled on the "
      "device only for an optimizer that skips an overflowing step there "
      "(FusedAdamW, FusedAdam, every gradient on one device); use "
      "clip_grad_by_norm");
  // An overflowing step's norm is inf or nan and its gradients follow; the
  // step that reads the same verdict skips them.
  scaler_.unscale_on_device_(params);
  return interface::OptimizerWrapper::clip_grad_by_norm_tensor(
      max_norm, norm_type);
}

void TorchAMPOptimizer::clip_grad_by_value(double clip_value) {
  if (!scaler_.unscale_(parameters())) {
    interface::OptimizerWrapper::clip_grad_by_value(clip_value);
  }
}

FP16TorchMixedPrecision::FP16TorchMixedPrecision(
    amp::GradScalerOptions options,
    std::optional<at::DeviceType> device)
    : MixedPrecision(device), options_(options) {}

void FP16TorchMixedPrecision::configure(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer) {
  if (model) {
    TORCH_INTERNAL_ASSERT(device_, "fp16: bind_device before configure");
    model = std::make_shared<AutocastModel>(model, *device_, at::kHalf);
  }
  if (optimizer) {
    optimizer = std::make_shared<TorchAMPOptimizer>(
        optimizer->optimizer_ptr(), options_);
  }
}

std::shared_ptr<MixedPrecision> make_mixed_precision(
    const std::string& name,
    at::DeviceType device) {
  if (name.empty() || name == "fp32" || name == "no") {
    return nullptr;
  }
  std::shared_ptr<MixedPrecision> out;
  if (name == "bf16") {
    out = std::make_shared<BF16MixedPrecision>();
  } else if (name == "fp16") {
    out = std::make_shared<FP16TorchMixedPrecision>();
  }
  if (out) {
    out->bind_device(device);
    return out;
  }
  TORCH_CHECK(
      false,
      "mixed_precision must be 'fp16', 'bf16' or 'fp32', got '",
      name,
      "'");
}

} // namespace mixed_precision
} // namespace booster
} // namespace colossalai
