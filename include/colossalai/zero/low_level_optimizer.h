#pragma once

#include <colossalai/checkpoint_io/state_dict.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/interface/optimizer.h>

#include <torch/arg.h>

#include <map>
#include <memory>
#include <vector>

namespace colossalai {
namespace zero {

struct LowLevelZeroOptimizerOptions {
  /// 1: optimizer states sharded, gradients all-reduced; 2: gradients
  /// reduce-scattered too, so a rank keeps only its slice.
  TORCH_ARG(int, stage) = 1;
  /// Working dtype of the model's parameters (kFloat, kBFloat16, kHalf).
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
  /// Dtype gradients travel in (default: the working dtype).
  TORCH_ARG(c10::optional<at::ScalarType>, communication_dtype) = c10::nullopt;
  /// Elements per gradient bucket.
  TORCH_ARG(int64_t, reduce_bucket_size) = 12 * 1000 * 1000;
  /// Start each bucket's reduction from backward hooks (else at the end).
  TORCH_ARG(bool, overlap_communication) = true;
  /// Global gradient norm limit; 0 disables clipping.
  TORCH_ARG(double, max_norm) = 0.0;
  /// fp16 dynamic loss scaling.
  TORCH_ARG(double, initial_scale) = 4294967296.0;
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, max_scale) = 4294967296.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 1000;
  TORCH_ARG(int64_t, hysteresis) = 2;
  /// Keep master weights, gradient slices and optimizer states on the CPU.
  TORCH_ARG(bool, cpu_offload) = false;
};

/// Bytes this rank holds for the model's training state.
struct MemoryStats {
  int64_t working_params = 0; // full parameters in the working dtype
  int64_t gradients = 0;      // gradient slices (fp32) + bucket buffers
  int64_t master_weights = 0; // fp32 slices (0 when the working dtype is fp32)
  int64_t optimizer_states = 0;
};

/// ZeRO stage 1/2 (`colossalai.zero.LowLevelZeroOptimizer`).
///
/// NOTE [ZeRO-1/2 layout]
/// Every parameter is flattened and padded to a multiple of the data-parallel
/// size N; rank r owns elements [r*s, (r+1)*s) with s = padded/N. The user's
/// optimizer is re-pointed at fp32 "master" slices, so it updates only what
/// this rank owns and keeps states for those slices alone. Gradients enter
/// buckets from gradient-accumulator hooks: a bucket stores, for each rank
/// j, the j-th slices of its parameters side by side, so one reduce-scatter
/// (stage 2) or all-reduce (stage 1) leaves every rank its own slices. After
/// the step, updated slices are all-gathered into the working parameters.
class LowLevelZeroOptimizer : public interface::OptimizerWrapper {
 public:
  LowLevelZeroOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optimizer,
      distributed::ProcessGroupPtr group,
      LowLevelZeroOptimizerOptions options);
  ~LowLevelZeroOptimizer() override;

  void backward(const at::Tensor& loss, bool retain_graph = false) override;
  void step() override;
  void zero_grad(bool set_to_none = true) override;
  double clip_grad_by_norm(double max_norm, double norm_type = 2.0) override;
  void clip_grad_by_value(double clip_value) override;

  /// Gradient synchronization on/off (no_sync, stage 1 only).
  void set_require_sync(bool require);
  bool last_step_skipped() const;
  double loss_scale() const;
  MemoryStats memory_stats() const;
  /// The working (model) parameters this optimizer manages.
  const std::vector<at::Tensor>& working_params() const;

  /// Full optimizer states by parameter id, gathered from every rank's
  /// slices (collective: every rank must call it).
  std::map<int64_t, checkpoint_io::StateDict> full_states();
  /// Keeps this rank's slice of a full state (from any world size or plugin).
  void load_full_state(
      int64_t id,
      const checkpoint_io::StateDict& state,
      const std::string& file);
  /// Re-reads the master slices from the working parameters (after the
  /// model's weights were loaded).
  void sync_master_from_working();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

} // namespace zero
} // namespace colossalai
