#include <colossalai/amp/shared_cast.h>

#include <colossalai/utils/compat.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

namespace colossalai {
namespace amp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<bool> g_shared_casts{true};

// One reader of the shared cast: forward hands out the cast's bytes as a
// tensor of its own (so the reader's backward node is its own, and the
// gradients meet at the input in its dtype, where autocast's casts would
// add them); backward is the cast's backward.
struct SharedCastFunction : torch::autograd::Function<SharedCastFunction> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& input,
      const at::Tensor& cast) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(input.scalar_type());
    auto out = at::empty({0}, cast.options());
    out.set_(cast);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto dtype =
        static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto& g = grads[0];
    return {g.defined() ? g.to(dtype) : at::Tensor(), at::Tensor()};
  }
};

} // namespace

SharedCast::SharedCast(at::Tensor input) : input_(std::move(input)) {
  // What autocast's linear casts: floating point other than float64, on
  // the CPU or a GPU where autocast is on, not yet in its dtype.
  if (!shared_casts() || !input_.defined() || !input_.is_floating_point() ||
      input_.scalar_type() == at::kDouble) {
    return;
  }
  const auto type = input_.device().type();
  if (type != at::kCPU && type != at::kCUDA) {
    return;
  }
  const auto target = compat::autocast_dtype(type);
  if (target.has_value() && *target != input_.scalar_type()) {
    target_ = target;
  }
}

at::Tensor SharedCast::get() const {
  if (!target_.has_value()) {
    return input_;
  }
  if (!cast_.defined()) {
    const at::NoGradGuard no_grad; // the readers' nodes carry the gradient
    cast_ = input_.to(*target_);
  }
  if (!input_.requires_grad() || !at::GradMode::is_enabled()) {
    return cast_;
  }
  return SharedCastFunction::apply(input_, cast_);
}

void set_shared_casts(bool on) {
  g_shared_casts.store(on);
}

bool shared_casts() {
  return g_shared_casts.load();
}

} // namespace amp
} // namespace colossalai
