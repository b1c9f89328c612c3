#include <colossalai/nn/optimizer/skips_step_on_device.h>

#include <colossalai/utils/compat.h>

#include <torch/optim/optimizer.h>

namespace colossalai {
namespace nn {
namespace optimizer {

void DeviceVerdict::record(const at::Tensor& found_inf) {
  if (compat::stream_capturing(found_inf.device())) {
    captured_ = found_inf; // read after each replay
  } else {
    pending_ = utils::DeferredRead(found_inf);
  }
}

void DeviceVerdict::after_replay() {
  if (captured_.defined()) {
    pending_ = utils::DeferredRead(captured_);
  }
}

c10::optional<bool> DeviceVerdict::settle(torch::optim::Optimizer& optimizer) {
  if (!pending_.defined()) {
    return c10::nullopt;
  }
  const bool skipped = pending_.value() != 0;
  pending_ = utils::DeferredRead();
  if (skipped) {
    auto* skipping = dynamic_cast<SkipsStepOnDevice*>(&optimizer);
    TORCH_INTERNAL_ASSERT(
        skipping != nullptr, "a verdict left to an optimizer that cannot skip");
    skipping->undo_step_counts();
  }
  return skipped;
}

} // namespace optimizer
} // namespace nn
} // namespace colossalai
