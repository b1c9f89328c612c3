// HybridAdamOptions and HybridAdamParamState: comparison, the options'
// learning-rate accessors and their (de)serialization.

#include <colossalai/nn/optimizer/hybrid_adam.h>

#include <torch/optim/serialize.h>

#include <string>

namespace colossalai {
namespace nn {
namespace optimizer {

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

} // namespace optimizer
} // namespace nn
} // namespace colossalai
