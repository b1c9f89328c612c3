#pragma once

// use_fp8 (LowLevelZeroPlugin, GeminiPlugin, HybridParallelPlugin): the
// model's forward runs inside a quantization::Fp8LinearScope, so its linear
// layers multiply in FP8 (quantization/fp8_linear.h).

#include <colossalai/initialize.h>
#include <colossalai/interface/model.h>
#include <colossalai/quantization/fp8.h>
#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/utils/compat.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

/// Refuses use_fp8 where it cannot run: before LibTorch 2.1, in float32
/// (FP8 products stand in for 16-bit ones) and on a GPU without FP8
/// matmuls.
inline void check_use_fp8(const std::string& who, at::ScalarType dtype) {
  TORCH_CHECK(
      quantization::fp8_supported(),
      who,
      ": use_fp8 needs LibTorch 2.1 or later (its float8 dtypes); this is ",
      TORCH_VERSION);
  TORCH_CHECK(
      dtype == at::kBFloat16 || dtype == at::kHalf,
      who,
      ": use_fp8 replaces 16-bit matmuls and needs precision 'bf16' or "
      "'fp16', got ",
      dtype == at::kFloat ? "'fp32'" : c10::toString(dtype));
  const auto device = current_device();
  TORCH_CHECK(
      !device.is_cuda() || compat::has_scaled_mm(device),
      who,
      ": use_fp8 needs FP8 matmuls (at::_scaled_mm): a GPU of compute "
      "capability 8.9 or later (Ada, Hopper) and LibTorch 2.4 or later; ",
      device,
      " is not one");
}

class Fp8LinearModel : public interface::ModelWrapper {
 public:
  Fp8LinearModel(
      std::shared_ptr<interface::ModelWrapper> inner,
      std::string who)
      : interface::ModelWrapper(std::move(inner)), who_(std::move(who)) {}

 protected:
  void pre_forward() override {
    if (!checked_) {
      before_ = quantization::fp8_linear_counts();
    }
    scope_.emplace();
  }
  void post_forward() noexcept override {
    scope_.reset();
    if (checked_) {
      return;
    }
    // The first forward says whether use_fp8 reached the model at all.
    checked_ = true;
    const auto now = quantization::fp8_linear_counts();
    const int64_t calls = now.calls - before_.calls;
    const int64_t fp8 = now.fp8 - before_.fp8;
    try {
      warn_unless_reached(calls, fp8);
    } catch (...) { // a handler that turns warnings into errors
    }
  }

 private:
  void warn_unless_reached(int64_t calls, int64_t fp8) const {
    if (calls == 0) {
      TORCH_WARN(
          who_,
          ": use_fp8 reached no linear layer in the model's first forward, "
          "which ran in 16 bits: FP8 takes the layers of "
          "colossalai::shardformer::layer and models, and "
          "colossalai::quantization::linear; LibTorch's torch::nn::Linear "
          "computes inside its compiled forward, where no scope reaches");
    } else if (fp8 == 0) {
      TORCH_WARN(
          who_,
          ": none of the ",
          calls,
          " linear products of the model's first forward ran in FP8: "
          "use_fp8 takes a weight that trains, 16-bit operands and sizes "
          "(rows, input and output features) that are multiples of 16");
    }
  }

  std::string who_;
  std::optional<quantization::Fp8LinearScope> scope_;
  quantization::Fp8LinearCounts before_;
  bool checked_ = false;
};

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
