#include "grad_ready_hook.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace colossalai {
namespace utils {

namespace {

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(uint64_t owner, std::function<void()> fn)
      : owner_(owner), fn_(std::move(fn)) {}
  uint64_t owner() const {
    return owner_;
  }
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  uint64_t owner_;
  std::function<void()> fn_;
};

} // namespace

GradAccumulatorPtr on_grad_accumulated(
    const at::Tensor& param,
    uint64_t owner,
    std::function<void()> fn) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  if (acc == nullptr) {
    return acc;
  }
  for (const auto& hook : acc->post_hooks()) {
    const auto* ours = dynamic_cast<const GradReadyHook*>(hook.get());
    if (ours != nullptr && ours->owner() == owner) {
      return acc; // installed before, on the same accumulator
    }
  }
  acc->add_post_hook(std::make_unique<GradReadyHook>(owner, std::move(fn)));
  return acc;
}

} // namespace utils
} // namespace colossalai
