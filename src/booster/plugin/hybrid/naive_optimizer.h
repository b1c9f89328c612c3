#pragma once

#include <colossalai/interface/optimizer.h>
#include <colossalai/placement/placement.h>

#include <memory>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

/// HybridParallelPlugin at zero_stage 0 (ColossalAI's
/// HybridParallel(Naive|AMP)Optimizer): DDP has averaged the gradients
/// over dp x sp; this sums the partial ones over their axis and clips by
/// the global norm over the mesh (NOTE [Placement table]) inside step.
class HybridParallelNaiveOptimizer : public interface::OptimizerWrapper {
 public:
  HybridParallelNaiveOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optim,
      std::shared_ptr<const placement::PlacementTable> table,
      double max_norm);

  void step() override;
  void zero_grad(bool set_to_none) override;
  double clip_grad_by_norm(double max_norm, double norm_type) override;

 private:
  void sum_partial_grads();

  std::shared_ptr<const placement::PlacementTable> table_;
  double max_norm_;
  bool summed_ = false;
};

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
