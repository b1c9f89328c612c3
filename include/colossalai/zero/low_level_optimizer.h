#pragma once

#include <colossalai/checkpoint_io/state_dict.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/interface/optimizer.h>
#include <colossalai/zero/sharded_optimizer.h>

#include <torch/arg.h>

#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace colossalai {
namespace zero {

struct LowLevelZeroOptimizerOptions {
  /// 1: optimizer states sharded, gradients accumulate whole between
  /// synchronizations (`no_sync` works); 2: only gradient slices are kept.
  /// Both reduce-scatter each bucket, since a rank steps only its slice.
  TORCH_ARG(int, stage) = 1;
  /// Working dtype of the model's parameters (kFloat, kBFloat16, kHalf).
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
  /// Dtype gradients travel in (default: the working dtype). With bf16
  /// weights it is also the dtype the gradient slices are kept in: bf16
  /// by default, float32 when set to kFloat (NOTE [Gradient shards in
  /// bf16]).
  TORCH_ARG(c10::optional<at::ScalarType>, communication_dtype) = c10::nullopt;
  /// Elements per gradient bucket.
  TORCH_ARG(int64_t, reduce_bucket_size) = 12 << 20;
  /// Start each bucket's reduction from backward hooks (else at the end).
  TORCH_ARG(bool, overlap_communication) = true;
  /// Global gradient norm limit; 0 disables clipping.
  TORCH_ARG(double, max_norm) = 0.0;
  /// fp16 dynamic loss scaling (ZeRO's defaults: 2^32, hysteresis 2).
  TORCH_ARG(amp::DynamicLossScalerOptions, loss_scaler) =
      amp::DynamicLossScalerOptions().initial_scale(4294967296.0);
  /// Keep master weights, gradient slices and optimizer states on the CPU.
  TORCH_ARG(bool, cpu_offload) = false;
  /// With cpu_offload: HybridAdam updates each bucket's host master slice
  /// as soon as its reduced gradient has reached the host, during the
  /// backward (NOTE [Host steps overlap the backward]); at one rank the
  /// bucket's weights are uploaded then too. Same weights bit for bit.
  /// Needs HybridAdam, no max_norm, no fp16, one backward per step.
  TORCH_ARG(bool, overlap_host_step) = false;
  /// Leave each bucket's post-step all-gather in flight when step()
  /// returns; the next forward waits for a bucket just before the first
  /// module that uses it (NOTE [All-gathers overlap the next forward]).
  /// Buckets at one rank have nothing to gather and complete in step().
  TORCH_ARG(bool, overlap_allgather) = false;
  /// Buckets whose group spans more than one node all-gather their
  /// parameters through FP8 (e4m3, per-rank scale; quantization/fp8.h):
  /// every rank's weights become the same 8-bit rounding of the fp32
  /// masters, which stay exact (float32 weights then get masters of their
  /// own). Their gradients reduce-scatter through FP8 too (e5m2, a scale
  /// per rank's slice), as in ColossalAI. Model saves gather the masters
  /// exactly first.
  TORCH_ARG(bool, fp8_communication) = false;
  /// Ranks holding the same shards as this one (LowLevelZeroPlugin's
  /// extra_dp_size): each bucket reduce-scattered over the optimizer's
  /// group is then all-reduced over them, so the copies step the same
  /// gradients. Null: one copy.
  TORCH_ARG(distributed::ProcessGroupPtr, replica_group) = nullptr;
};

/// Bytes this rank holds for the model's training state.
struct MemoryStats {
  int64_t working_params = 0; // full parameters in the working dtype
  int64_t gradients = 0;      // gradient slices + bucket buffers
  int64_t master_weights = 0; // fp32 slices (0 when the working dtype is fp32)
  int64_t optimizer_states = 0;
};

/// ZeRO stage 1/2 (`colossalai.zero.LowLevelZeroOptimizer`).
///
/// NOTE [ZeRO-1/2 layout]
/// Parameters are grouped into buckets of about `reduce_bucket_size`
/// elements, in reverse registration order (the order backward produces
/// gradients). Each bucket is one group in the flat shard layout (NOTE
/// [Flat shard layout]): the parameters become views of one padded flat
/// buffer in the working dtype and rank r owns elements [r*s, (r+1)*s) as
/// fp32 master weights (in fp32 without offload, that slice *is* the
/// weights: held once). The user's optimizer steps this rank's pieces, so
/// it keeps states for them alone. Gradients enter the bucket from
/// gradient-accumulator hooks (the shared GradBucketer); one reduce-scatter
/// per bucket (both stages) leaves every rank its averaged gradient shard.
/// After the step, one all-gather per bucket rebuilds the working weights.
///
/// NOTE [Gradient shards in bf16]
/// With bf16 weights and bf16 communication (the default) the gradient
/// slices stay bf16, as ColossalAI's LowLevelZero keeps them in the working
/// dtype: the reduced gradient is bf16 already, so holding it in float32
/// changes no value and costs 2 bytes per parameter more (ZeRO's mixed
/// precision formula, 2 + 2 + 12 bytes per parameter at one rank, counts
/// 16-bit gradients). The optimizer reads them as they are: fp32 masters
/// whose .grad is bf16. That needs an optimizer whose update is then the
/// same as from their float32 values (detail::steps_from_low_precision_grads):
/// FusedAdamW / FusedAdam and HybridAdam convert as they step (the CUDA
/// AdamW kernel reads bf16; elsewhere slices of at most 2^26 elements at a
/// time), LibTorch's Adam / AdamW promote in their ops. Any other optimizer
/// (SGD would keep its momentum buffer in bf16) gets float32 slices.
/// Gradients summed over several backwards (accumulation) round to bf16 at
/// each sum, and a clipping coefficient multiplies them in bf16, as in
/// PyTorch with bf16 parameters (ColossalAI clips the float32 copies it
/// makes at the step); communication_dtype float32 keeps float32 slices.
/// fp16 keeps float32 slices (the loss scale is undone in them).
class LowLevelZeroOptimizer : public ShardedOptimizer {
 public:
  LowLevelZeroOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optimizer,
      distributed::ProcessGroupPtr group,
      LowLevelZeroOptimizerOptions options);
  /// Parameters sharded over groups of their own (ColossalAI's
  /// `pg_to_param_list`: under expert parallelism the experts over the
  /// ranks holding the same ones, the rest over `group`). Each listed
  /// group must lie inside `group`, over which the global norm and the
  /// overflow decision are combined; a bucket never mixes groups.
  LowLevelZeroOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optimizer,
      distributed::ProcessGroupPtr group,
      LowLevelZeroOptimizerOptions options,
      std::vector<
          std::pair<distributed::ProcessGroupPtr, std::vector<at::Tensor>>>
          pg_to_param_list);
  ~LowLevelZeroOptimizer() override;

  /// Steps, then clears the gradient shards (as ColossalAI does).
  void step() override;
  /// Capturable at one rank, without fp16 or cpu_offload, over FusedAdamW
  /// or FusedAdam (booster::GraphedStep); max_norm clips on the device.
  std::string graph_capture_blocker() const override;
  /// Makes the gradient hooks again on the current stream (their
  /// accumulator nodes run where they were made: at boost, the default
  /// stream, which a capture on another stream cannot include).
  void prepare_graph_stream() override;

  /// Gradient synchronization on/off (no_sync, stage 1 only).
  void set_require_sync(bool require);
  bool require_sync() const;
  /// Reduces now the gradients that backwards with sync off accumulated in
  /// `.grad` (stage 1; pipelines: once per step, after the last
  /// micro-batch).
  void sync_gradients();
  MemoryStats memory_stats() const;
  /// The working (model) parameters this optimizer manages.
  const std::vector<at::Tensor>& working_params() const;
  /// Elements in each bucket's padded flat buffer.
  std::vector<int64_t> bucket_numels() const;
  /// All-gathers issued by the last step (one per bucket).
  int64_t gathers_last_step() const;

  /// overlap_allgather (NOTE [All-gathers overlap the next forward]).
  /// The bucket holding `param` (one of working_params()), or -1.
  int64_t bucket_of(const at::Tensor& param) const;
  /// The order the steps issue their all-gathers in: a permutation of the
  /// buckets, the same on every rank (default: bucket order).
  void set_gather_order(std::vector<size_t> order);
  const std::vector<size_t>& gather_order() const;
  /// Completes the listed buckets' all-gathers still in flight, in order.
  void wait_gathers(const std::vector<size_t>& buckets);
  /// Completes every all-gather still in flight: the weights then hold the
  /// last step's values (step() and a load of the optimizer's state do it
  /// first).
  void wait_all_gathers();
  /// All-gathers issued and not yet completed.
  int64_t gathers_in_flight() const;

  /// fp8_communication: all-gathers the master slices into the weights at
  /// full precision (collective over every bucket's group; the next step
  /// rounds them to FP8 again). Model saves call it. Nothing otherwise.
  void gather_exact_weights();
  /// Re-reads the master slices from the working parameters (after the
  /// model's weights were loaded).
  void sync_master_from_working();

  struct Impl;

 protected:
  void after_step() override;
  /// cpu_offload at one rank: each bucket's weights refreshed as soon as
  /// HybridAdam finished its master shard.
  bool publishes_during_step() const override;
  bool group_stepped_on_host(size_t k) override;
  void zero_extra_grads(bool set_to_none) override;

 private:
  // overlap_host_step: checks what it needs and hands host buckets to
  // HybridAdam::step_ahead during the backward.
  void overlap_host_step();

  std::shared_ptr<Impl> impl_;
};

} // namespace zero
} // namespace colossalai
