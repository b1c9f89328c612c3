#include <colossalai/interface/model.h>

namespace colossalai {
namespace interface {

ModelWrapper::ModelWrapper(std::shared_ptr<torch::nn::Module> module)
    : module_(std::move(module)) {
  TORCH_CHECK(module_ != nullptr, "ModelWrapper: the model is null");
}

ModelWrapper::ModelWrapper(std::shared_ptr<ModelWrapper> inner)
    : inner_(std::move(inner)) {
  TORCH_CHECK(inner_ != nullptr, "ModelWrapper: the wrapped model is null");
  module_ = inner_->unwrap();
}

void ModelWrapper::enter_forward() {
  pre_forward();
  if (inner_) {
    try {
      inner_->enter_forward();
    } catch (...) {
      post_forward();
      throw;
    }
  }
}

void ModelWrapper::synchronize_weights() {
  for (ModelWrapper* m = this; m != nullptr; m = m->inner_.get()) {
    m->finish_weight_updates();
  }
}

void ModelWrapper::exit_forward() noexcept {
  if (inner_) {
    inner_->exit_forward();
  }
  post_forward();
}

} // namespace interface
} // namespace colossalai
