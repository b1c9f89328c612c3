#include <colossalai/booster/mixed_precision/bf16.h>
#include <colossalai/booster/mixed_precision/fp16_torch.h>

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

void TorchAMPOptimizer::step() {
  last_step_skipped_ = scaler_.unscale_(parameters());
  if (!last_step_skipped_) {
    optim_->step();
  }
  scaler_.update();
}

double TorchAMPOptimizer::clip_grad_by_norm(double max_norm, double norm_type) {
  if (scaler_.unscale_(parameters())) {
    return std::numeric_limits<double>::infinity(); // step will be skipped
  }
  return interface::OptimizerWrapper::clip_grad_by_norm(max_norm, norm_type);
}

at::Tensor TorchAMPOptimizer::clip_grad_by_norm_tensor(
    double /*max_norm*/,
    double /*norm_type*/) {
  TORCH_CHECK(
      false,
      "clip_grad_by_norm_tensor: with fp16 the gradients are unscaled after "
      "an overflow check read on the host; use clip_grad_by_norm");
  return at::Tensor();
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
