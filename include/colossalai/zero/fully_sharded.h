#pragma once

/// Fully sharded data parallelism (ZeRO-3, PyTorch's FSDP) for LibTorch
/// modules. Most users reach it through `TorchFSDPPlugin`; this header is the
/// engine underneath.
///
/// NOTE [FSDP units]
/// A unit is a module whose parameters are flattened into one padded flat
/// buffer of P = S * s elements (S: ranks sharing the shards); rank r owns
/// elements [r*s, (r+1)*s) as an fp32 shard, the only copy of those weights
/// at rest. The parameters stay the module's own tensors: they are views of
/// a full buffer whose storage is allocated and filled by an all-gather
/// before the unit computes and freed in place afterwards, so autograd's
/// saved references to them remain valid and see the data again when it is
/// re-gathered for backward.
///
/// C++ modules have no forward hooks, so a unit's boundaries must be visible:
///  - the root module is always a unit (it owns every parameter no finer
///    unit owns) and is gathered around the boosted model's forward;
///  - finer units are modules chosen by `auto_wrap_policy` that derive from
///    `colossalai::nn::HookableModule` and open a `ForwardScope` in their
///    forward (the blocks of `colossalai::models` do). Choosing a module that
///    does not is an error at boost time.
/// The output of every non-root unit carries a gradient hook: when backward
/// reaches it, the unit is re-gathered (and, with backward prefetch, the next
/// unit in backward order starts gathering). When all of a unit's gradients
/// have been accumulated, they are copied into one flat buffer,
/// reduce-scattered (averaged) into the unit's gradient shard (fp32, or the
/// reduce dtype with keep_low_precision_grads), and the
/// full gradients and parameters are freed. A unit whose forward runs under
/// activation checkpointing (nn::checkpoint) is released after its first
/// run and gathered again when backward recomputes it; it then stays
/// gathered until its gradients are reduced. A gradient shard in host
/// memory receives its reduced gradient through a copy that overlaps the
/// rest of the backward (NOTE [Offload copies overlap the backward]).
///
/// The optimizer sees one tensor per original parameter: the part of it that
/// lies in this rank's shard (possibly empty). So parameter groups, per-group
/// options and checkpoints keep the model's own parameter order, and full
/// optimizer states gather from those pieces.

#include <colossalai/checkpoint_io/state_dict.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/interface/model.h>
#include <colossalai/interface/optimizer.h>
#include <colossalai/zero/sharded_optimizer.h>

#include <torch/arg.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace zero {

enum class ShardingStrategy {
  /// Parameters, gradients and optimizer states sharded; a unit's parameters
  /// are freed after its forward and re-gathered for its backward.
  kFullShard,
  /// As kFullShard, but parameters stay gathered from forward to backward.
  kShardGradOp,
  /// Nothing sharded: DDP-like, gradients all-reduced.
  kNoShard,
  /// kFullShard inside groups of `hybrid_shard_size` ranks (a node), the
  /// groups replicating each other.
  kHybridShard,
};

enum class BackwardPrefetch {
  /// Gather a unit only when backward reaches it.
  kNone,
  /// Start gathering the next unit (in backward order) when the current
  /// unit's backward starts: communication overlaps its computation.
  kBackwardPre,
  /// Start it when the current unit's gradients are complete.
  kBackwardPost,
};

/// How a unit's state is placed between the device and the host tier
/// (Gemini's placement policies, NOTE [Gemini placement]).
enum class PlacementPolicy {
  /// Fixed at construction by offload_optim_fraction (fp32 shards, gradient
  /// shards, optimizer states) and offload_param_fraction.
  kStatic,
  /// Every unit's fp32 shard, gradient shard and optimizer states live in
  /// the host tier; its low-precision parameter shard is cached on the
  /// device while the budget allows and evicted, furthest next use first,
  /// when a gather needs room. The budget for model data is the device
  /// capacity minus the non-model memory measured at the same moment of the
  /// first (warm-up) step.
  kAuto,
};

/// Gemini's placement of the units (NOTE [Gemini placement]); TorchFSDP
/// uses the defaults (every unit on the device, resharded after use) and
/// FullyShardedOptions::cpu_offload.
struct PlacementOptions {
  TORCH_ARG(PlacementPolicy, policy) = PlacementPolicy::kStatic;
  /// Static: share of the units' bytes, first units first (last units
  /// first with overlap_host_step, whose host updates then overlap the
  /// backward of the rest), whose shards and gradient shards (and so
  /// optimizer states) live in host memory: units are offloaded in order
  /// until the offloaded bytes reach this share (Gemini's
  /// offload_optim_frac; FullyShardedOptions::cpu_offload is 1.0). On a
  /// CPU-only build both tiers are host memory; memory_stats() still
  /// reports what is placed in the host tier.
  TORCH_ARG(double, offload_optim_fraction) = 0.0;
  /// Share of the units' bytes, last units first, whose parameters stay
  /// gathered between uses (Gemini's shard_param_frac = 1 - this): they are
  /// gathered once and refreshed after each step instead of before every
  /// forward and backward; gradients and optimizer states stay sharded.
  TORCH_ARG(double, keep_gathered_fraction) = 0.0;
  /// Static: of the units whose fp32 shards are in the host tier, this share
  /// (first units first) keeps no device copy of its parameter shard, so
  /// each gather reads the host; the others keep one, refreshed after each
  /// step.
  TORCH_ARG(double, offload_param_fraction) = 0.0;
  /// Device memory this rank may use, in bytes; 0: the device's total
  /// memory (CUDA) or no limit (a CPU-only build, where the device tier is
  /// host memory that is accounted and, under kAuto, kept within this
  /// budget).
  TORCH_ARG(int64_t, device_capacity) = 0;
  /// kAuto, warm-up step: share of the capacity kept for non-model data.
  TORCH_ARG(double, warmup_non_model_data_ratio) = 0.8;
  /// kAuto, later steps: share of the capacity that may be used at all.
  TORCH_ARG(double, steady_cuda_cap_ratio) = 0.9;
  /// kAuto: share of the device margin (the capacity times
  /// steady_cuda_cap_ratio, less the warm-up step's peak non-model memory
  /// and the model data that must stay on the device) that takes units'
  /// fp32 shards, gradient shards and optimizer states at the first step,
  /// units in order while each one's four fp32 copies fit, so that their
  /// optimizer steps run on the device (Gemini's gpu_margin_mem_ratio;
  /// NOTE [Gemini placement]). 0: every unit stays in the host tier.
  TORCH_ARG(double, gpu_margin_mem_ratio) = 0.0;
};

/// What the placement did, in bytes (NOTE [Gemini placement]). Moves count
/// bytes that cross between the tiers; on a CPU-only build both tiers are
/// host memory and the counts are what a device would have moved.
struct PlacementStats {
  int64_t device_capacity = 0; ///< the budget; 0: none
  int64_t device_model = 0;    ///< model data in the device tier now
  int64_t host_model = 0;      ///< model data in the host tier now
  int64_t non_model = 0;       ///< measured at the last moment
  /// Largest device_model + non_model seen at a moment since the last
  /// reset_peak_memory_stats().
  int64_t peak_device = 0;
  int64_t peak_non_model = 0;
  int64_t host_to_device = 0; ///< bytes moved since construction
  int64_t device_to_host = 0;
  int64_t evictions = 0; ///< parameter shards evicted (kAuto)
  int64_t moments = 0;   ///< moments recorded in the warm-up step
  bool warmed_up = false;
  /// kAuto with gpu_margin_mem_ratio: the device margin measured at the
  /// first step (-1: no capacity, so no limit), and the units (and their
  /// fp32 shard bytes) moved into it.
  int64_t device_margin = 0;
  int64_t margin_units = 0;
  int64_t margin_shard_bytes = 0;
};

/// Chooses units: called for every sub-module (not the root) in pre-order
/// with its dotted name and its parameter count (sub-modules included).
using AutoWrapPolicy = std::function<
    bool(const std::string& name, torch::nn::Module& module, int64_t numel)>;

/// Every module of type `T` (e.g. `colossalai::models::GPT2BlockImpl`)
/// becomes a unit.
template <class T>
AutoWrapPolicy module_type_wrap_policy() {
  return [](const std::string&, torch::nn::Module& m, int64_t) {
    return dynamic_cast<T*>(&m) != nullptr;
  };
}
/// Every hookable module with at least `min_num_params` parameters becomes a
/// unit (modules that cannot be units are skipped).
AutoWrapPolicy size_based_wrap_policy(int64_t min_num_params);
/// Modules whose dotted name matches the ECMAScript regular expression.
AutoWrapPolicy name_wrap_policy(const std::string& pattern);

struct FullyShardedOptions {
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  /// Finer units; null: the whole model is one unit.
  TORCH_ARG(AutoWrapPolicy, auto_wrap_policy) = nullptr;
  TORCH_ARG(BackwardPrefetch, backward_prefetch) =
      BackwardPrefetch::kBackwardPre;
  /// Start gathering the next unit (in forward order) when one starts.
  TORCH_ARG(bool, forward_prefetch) = false;
  /// Dtype parameters are gathered and computed in (kFloat, kBFloat16).
  /// Shards and optimizer states stay fp32; gradient shards too unless
  /// keep_low_precision_grads.
  TORCH_ARG(at::ScalarType, param_dtype) = at::kFloat;
  /// Dtype gradients are reduced in (default: param_dtype).
  TORCH_ARG(c10::optional<at::ScalarType>, reduce_dtype) = c10::nullopt;
  /// Keep the gradient shards in a 16-bit reduce_dtype instead of float32
  /// (PyTorch's MixedPrecision.keep_low_precision_grads; GeminiPlugin sets
  /// it for bf16 with an optimizer that steps from such gradients, as
  /// ColossalAI's chunks keep them): 2 bytes per parameter of the shard
  /// less; gradients summed over backwards, clipped or unscaled round to
  /// that dtype (NOTE [Gradient shards in bf16]), and the optimizer gets
  /// 16-bit gradients (as in PyTorch, LibTorch's SGD then keeps its
  /// momentum in their dtype; with fp16 the loss scale is undone in fp16).
  /// No effect with a float32 reduce_dtype.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  /// Parameter all-gathers travel as FP8 (e4m3) and gradient
  /// reduce-scatters (and the replicas' all-reduce of kHybridShard /
  /// kNoShard) as FP8 (e5m2) where their group spans more than one node
  /// (quantization/fp8.h, as ColossalAI's fp8_communication): a quarter of
  /// float32's bytes. The forward and backward compute with weights rounded
  /// to 8 bits (within 2^-4 of the fp32 shards, which stay exact);
  /// summon_full_params, stream_full_state and so checkpoints gather the
  /// shards exactly. Needs LibTorch 2.1 or later.
  TORCH_ARG(bool, fp8_communication) = false;
  /// Dtype buffers are kept in (default: param_dtype).
  TORCH_ARG(c10::optional<at::ScalarType>, buffer_dtype) = c10::nullopt;
  /// Shards, gradient shards (and so optimizer states) in host memory, and
  /// no device copy of the parameter shards: each gather reads the host
  /// (PyTorch's CPUOffload(offload_params=True)).
  TORCH_ARG(bool, cpu_offload) = false;
  /// Gemini's tiers (what TorchFSDPPlugin leaves at their defaults): where
  /// each unit's state lives and which units stay gathered.
  TORCH_ARG(PlacementOptions, placement) = {};
  /// NOTE [Host steps overlap the backward]: each unit whose fp32 shard
  /// lives on the host (cpu_offload, Gemini's host tier) is updated by
  /// HybridAdam as soon as its reduced gradient has reached the host, on a
  /// background thread, and its device parameter shard uploaded on a side
  /// stream, while the device computes the rest of the backward; step()
  /// then waits for them and updates the rest. The update is step()'s
  /// arithmetic, bit for bit where the same units are on the host (static
  /// placement puts the last ones there with it). Needs HybridAdam, no
  /// max_norm and no fp16 loss scaling (both need every gradient before
  /// any update),
  /// one backward per step (no accumulation over backwards), and the
  /// learning rate set before the backward (step() refuses a changed one).
  TORCH_ARG(bool, overlap_host_step) = false;
  /// Modules whose parameters (their sub-modules' included) are neither
  /// sharded nor synchronized, as in PyTorch.
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules) =
      {};
  /// Called on every unit's module before sharding (e.g. to initialise
  /// weights).
  TORCH_ARG(std::function<void(torch::nn::Module&)>, param_init_fn) = nullptr;
  /// Broadcast rank 0's parameters and buffers before sharding.
  TORCH_ARG(bool, sync_module_states) = false;
  /// 0: one unit per module chosen by auto_wrap_policy (and the root).
  /// > 0: parameters packed in order into chunks of this many elements
  /// (Gemini's layout, NOTE [Gemini chunks]); the chosen modules still
  /// decide when chunks gather (each gathers the chunks its parameters fall
  /// in), a chunk may serve several modules.
  TORCH_ARG(int64_t, chunk_size) = 0;
  /// Ranks sharing shards under kHybridShard; 0: this node's ranks (the
  /// launcher's LOCAL_WORLD_SIZE).
  TORCH_ARG(int, hybrid_shard_size) = 0;
  /// Data-parallel ranks; null: all.
  TORCH_ARG(distributed::ProcessGroupPtr, process_group) = nullptr;
};

/// Bytes of model state this rank holds (tensors counted by their storage).
struct FullyShardedMemoryStats {
  /// Full (gathered) parameter buffers currently allocated.
  int64_t gathered_params = 0;
  /// fp32 parameter shards.
  int64_t shards = 0;
  /// Full gradients not yet reduced, reduction buffers and gradient shards.
  int64_t gradients = 0;
  int64_t optimizer_states = 0;
  /// Device copies of host-tier shards in param_dtype (placement).
  int64_t param_shards = 0;
  /// Of `shards` and `gradients`: the bytes placed in the host tier
  /// (cpu_offload, placement().offload_optim_fraction()). Not part of total().
  int64_t offloaded = 0;
  int64_t total() const {
    return gathered_params + shards + gradients + optimizer_states +
        param_shards;
  }
};

namespace detail {
struct FsdpState;
} // namespace detail

class FullyShardedOptimizer;

/// A module sharded as NOTE [FSDP units] describes. Collective: every rank
/// of the data-parallel group constructs it with the same model.
class FullyShardedModel : public interface::ModelWrapper {
 public:
  FullyShardedModel(
      std::shared_ptr<interface::ModelWrapper> inner,
      FullyShardedOptions options);
  ~FullyShardedModel() override;

  /// Re-points `optimizer` at this rank's shards and wraps it.
  std::shared_ptr<FullyShardedOptimizer> shard_optimizer(
      std::shared_ptr<torch::optim::Optimizer> optimizer,
      ShardedOptimizerOptions options = {});

  /// RAII: every parameter holds its full fp32 value while the guard lives
  /// (for evaluation, inspection or checkpoints); with `writeback`, changes
  /// are written back to the shards when it ends (not when it ends by an
  /// exception: the shards then keep their values). Collective.
  class FullParams {
   public:
    FullParams(FullParams&& other) noexcept;
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;
    FullParams& operator=(FullParams&&) = delete;
    ~FullParams() noexcept(false);

   private:
    friend class FullyShardedModel;
    FullParams(std::shared_ptr<detail::FsdpState> state, bool writeback);
    std::shared_ptr<detail::FsdpState> state_;
    bool writeback_;
    int uncaught_; // exceptions in flight at construction
  };
  FullParams summon_full_params(bool writeback = false);

  /// Hands every parameter's full fp32 value (and every buffer) to `sink`
  /// by its dotted name, one unit at a time: a unit's shards are gathered to
  /// rank 0 of the shard group only and released before the next unit
  /// (collective; `sink` runs on that rank only). For saves that must not
  /// put the whole model on every rank.
  void stream_full_state(
      const std::function<void(const std::string&, const at::Tensor&)>& sink);

  /// Dotted names of the units ("" is the root), in construction order.
  std::vector<std::string> unit_names() const;
  /// Elements in each unit's padded flat buffer.
  std::vector<int64_t> unit_numels() const;
  /// Order the units ran in during the first forward.
  std::vector<std::string> execution_order() const;

  FullyShardedMemoryStats memory_stats() const;
  /// Placement between the device and the host tier (Gemini).
  PlacementStats placement_stats() const;
  /// The largest total seen since construction or the last reset, sampled
  /// whenever a unit is gathered, a unit's gradients are complete or the
  /// optimizer steps.
  FullyShardedMemoryStats peak_memory_stats() const;
  void reset_peak_memory_stats();

  /// Whether some of its traffic travels as FP8: fp8_communication, and
  /// the shard group or the replicas span more than one node.
  bool fp8_communication() const;

  /// Number of all-gathers started by backward prefetch (for tests).
  int64_t prefetch_count() const;

  void set_require_sync(bool require);

  const std::shared_ptr<detail::FsdpState>& state() const {
    return state_;
  }

 protected:
  at::Tensor transform_input(const at::Tensor& input) override;
  void pre_forward() override;
  void post_forward() noexcept override;

 private:
  std::shared_ptr<detail::FsdpState> state_;
};

/// The optimizer of a FullyShardedModel: steps only this rank's shards
/// (norm, clipping, loss scaling and full states from ShardedOptimizer).
/// With param_dtype float16 it scales the loss dynamically.
class FullyShardedOptimizer : public ShardedOptimizer {
 public:
  FullyShardedOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optimizer,
      std::shared_ptr<detail::FsdpState> state,
      ShardedOptimizerOptions options = {});

  void step() override;

 protected:
  void after_step() override;
  /// Units whose fp32 shards live on the host refresh their device
  /// parameter shards as soon as HybridAdam finished them.
  bool publishes_during_step() const override;
  bool group_stepped_on_host(size_t k) override;
  void zero_extra_grads(bool set_to_none) override;

 private:
  // FullyShardedOptions::overlap_host_step: checks what it needs and hands
  // host units to HybridAdam::step_ahead during the backward.
  void overlap_host_step();

  std::shared_ptr<detail::FsdpState> state_;
};

} // namespace zero
} // namespace colossalai
