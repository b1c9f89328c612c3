#include <colossalai/nn/hookable_module.h>

namespace colossalai {
namespace nn {

ForwardScope::ForwardScope(ForwardHooks* hooks) : hooks_(hooks) {
  if (hooks_ != nullptr) {
    hooks_->pre_forward();
  }
}

ForwardScope::ForwardScope(ForwardScope&& other) noexcept
    : hooks_(other.hooks_) {
  other.hooks_ = nullptr;
}

ForwardScope::~ForwardScope() {
  if (hooks_ != nullptr) {
    hooks_->abort_forward();
  }
}

at::Tensor ForwardScope::exit(const at::Tensor& output) {
  auto* hooks = hooks_;
  hooks_ = nullptr;
  return hooks != nullptr ? hooks->post_forward(output) : output;
}

} // namespace nn
} // namespace colossalai
