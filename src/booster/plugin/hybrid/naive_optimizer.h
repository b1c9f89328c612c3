#pragma once

#include <colossalai/interface/optimizer.h>
#include <colossalai/placement/placement.h>

#include <memory>
#include <vector>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

/// HybridParallelPlugin at zero_stage 0 (ColossalAI's
/// HybridParallel(Naive|AMP)Optimizer): DDP has averaged the gradients
/// over dp x sp; this sums the partial ones over their axis and clips by
/// the global norm over the mesh (NOTE [Placement table]) inside step.
/// Under expert parallelism DDP leaves the experts alone: their gradients
/// are averaged here over the ranks holding the same experts, and the norm
/// adds every expert-parallel rank's experts to the rest counted once.
class HybridParallelNaiveOptimizer : public interface::OptimizerWrapper {
 public:
  HybridParallelNaiveOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optim,
      std::shared_ptr<const placement::PlacementTable> table,
      double max_norm);

  void step() override;
  void zero_grad(bool set_to_none) override;
  double clip_grad_by_norm(double max_norm, double norm_type) override;
  /// Refused: the norm over the mesh is reduced on the host.
  at::Tensor clip_grad_by_norm_tensor(double max_norm, double norm_type)
      override;

  /// This rank's expert parameters, averaged over `moe_dp` and split over
  /// `ep`.
  void set_experts(
      std::vector<at::Tensor> params,
      distributed::ProcessGroupPtr moe_dp,
      distributed::ProcessGroupPtr ep);

 private:
  /// clip_grad_by_norm's scaling with the norm and coefficient left on the
  /// device (the step's max_norm reads nothing back); returns the norm.
  at::Tensor clip_on_device(double max_norm, double norm_type);
  // Partial gradients summed, experts averaged: once per step.
  void sum_partial_grads();

  std::shared_ptr<const placement::PlacementTable> table_;
  double max_norm_;
  bool summed_ = false;
  std::vector<at::Tensor> experts_;
  distributed::ProcessGroupPtr moe_dp_, ep_;
};

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
