#pragma once

// The model wrapper of overlap_allgather (LowLevelZeroPlugin and
// HybridParallelPlugin with zero_stage 1-2): NOTE [All-gathers overlap the
// next forward].

#include <colossalai/interface/model.h>

#include "../../zero/low_level/forward_gather_waits.h"

#include <memory>
#include <string>
#include <utility>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

class GatherWaitModel : public interface::ModelWrapper {
 public:
  GatherWaitModel(
      std::shared_ptr<interface::ModelWrapper> inner,
      const std::shared_ptr<zero::LowLevelZeroOptimizer>& zero,
      const std::string& who)
      : interface::ModelWrapper(std::move(inner)),
        waits_(*unwrap(), zero, who) {}

  /// What a forward waits for before it begins (a pipeline's step calls
  /// it: its stages do not run through the wrappers).
  void before_forward() {
    waits_.before_forward();
  }

 protected:
  void pre_forward() override {
    waits_.before_forward();
  }
  void finish_weight_updates() override {
    waits_.wait_all();
  }

 private:
  zero::detail::ForwardGatherWaits waits_;
};

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
