#pragma once

#include <colossalai/interface/model.h>

#include <memory>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

// The outermost wrapper under pp_size > 1: the model runs stage by stage
// inside execute_pipeline; a direct call is a user error.
class PipelineGuardModel : public interface::ModelWrapper {
 public:
  explicit PipelineGuardModel(std::shared_ptr<interface::ModelWrapper> inner)
      : interface::ModelWrapper(std::move(inner)) {}
  // Stage forwards run inside this scope.
  struct Scope {
    explicit Scope(PipelineGuardModel& m) : m_(m) {
      m_.in_schedule_ = true;
      try {
        m_.enter_forward();
      } catch (...) {
        m_.in_schedule_ = false;
        throw;
      }
    }
    ~Scope() {
      m_.exit_forward();
      m_.in_schedule_ = false;
    }
    PipelineGuardModel& m_;
  };

 protected:
  void pre_forward() override {
    TORCH_CHECK(
        in_schedule_,
        "HybridParallelPlugin",
        ": with pp_size > 1 the model runs through "
        "booster.execute_pipeline(data_iter, model, criterion, optimizer), "
        "not by calling it");
  }

 private:
  bool in_schedule_ = false;
};

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
