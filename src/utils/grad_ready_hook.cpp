#include "grad_ready_hook.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace colossalai {
namespace utils {

namespace {

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

} // namespace

GradAccumulatorPtr on_grad_accumulated(
    const at::Tensor& param,
    std::function<void()> fn) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  if (acc != nullptr) {
    acc->add_post_hook(std::make_unique<GradReadyHook>(std::move(fn)));
  }
  return acc;
}

} // namespace utils
} // namespace colossalai
