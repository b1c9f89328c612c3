#pragma once

#include <colossalai/booster/plugin/dp_plugin_base.h>
#include <colossalai/zero/fully_sharded.h>

#include <string>

namespace colossalai {
namespace booster {
namespace plugin {

/// Options of GeminiPlugin, with ColossalAI's names and defaults.
struct GeminiPluginOptions {
  /// Chunk size in elements; 0: searched (search_range_m, hidden_dim,
  /// min_chunk_size_m), as ColossalAI does without a chunk_config_dict.
  TORCH_ARG(int64_t, chunk_size) = 0;
  /// "static" (ColossalAI's default): the fractions below place the chunks;
  /// "auto": every chunk's fp32 shard, gradient and optimizer states on the
  /// host (those gpu_margin_mem_ratio moves aside), its parameter shard
  /// cached on the device while the budget allows (NOTE [Gemini placement]).
  TORCH_ARG(std::string, placement_policy) = "static";
  /// Accepted: several backward calls before a step always accumulate
  /// (reduced) gradients in the gradient shards (bf16 with precision bf16,
  /// as ColossalAI's chunks; float32 otherwise). As in ColossalAI, there is
  /// no no_sync.
  TORCH_ARG(bool, enable_gradient_accumulation) = false;
  /// > 0: while a module computes, the chunks of the next module (in
  /// forward, then in backward order) are gathered ahead, whatever their
  /// number; 0: chunks are gathered when needed.
  TORCH_ARG(int, max_prefetch) = 0;
  /// Share of chunk bytes that are resharded after use; the rest (the last
  /// chunks) stay gathered between uses, ZeRO-2-like: more memory, no
  /// re-gather for backward. Their gradients and optimizer states stay
  /// sharded.
  TORCH_ARG(double, shard_param_frac) = 1.0;
  /// Static: share of chunk bytes (first chunks first; last chunks first
  /// with overlap_host_step) whose fp32 shards, gradients and optimizer
  /// states live in host memory; the optimizer updates them there.
  TORCH_ARG(double, offload_optim_frac) = 0.0;
  /// Static, with shard_param_frac 1 and offload_optim_frac 1: share of
  /// chunk bytes (first chunks first) that keep no device copy of their
  /// parameter shard; each gather reads the host.
  TORCH_ARG(double, offload_param_frac) = 0.0;
  /// Auto: share of the device capacity kept for non-model data during the
  /// first (warm-up) step, and share of it usable in later steps.
  TORCH_ARG(double, warmup_non_model_data_ratio) = 0.8;
  TORCH_ARG(double, steady_cuda_cap_ratio) = 0.9;
  /// Auto: share of the device memory the first step finds spare (after
  /// the warm-up step's non-model peak) that takes chunks' fp32 shards,
  /// gradients and optimizer states, chunks in order while they fit; their
  /// optimizer steps then run on the device (NOTE [Gemini placement]).
  /// 0: every chunk's states stay on the host. Static placement refuses
  /// a ratio above 0 (offload_optim_frac places its states).
  TORCH_ARG(double, gpu_margin_mem_ratio) = 0.0;
  /// Bytes of device memory this rank may use (an addition, in place of
  /// ColossalAI's process memory fraction); 0: the device's total (CUDA)
  /// or no limit. On a CPU-only build the device tier is host memory that
  /// is accounted, and "auto" keeps it within this budget.
  TORCH_ARG(int64_t, device_memory_capacity) = 0;
  /// "fp16" (needs CUDA), "bf16", or "fp32" (an addition: no low-precision
  /// copy at all).
  TORCH_ARG(std::string, precision) = "fp16";
  /// Only true is supported (the shards are the fp32 master weights).
  TORCH_ARG(bool, master_weights) = true;
  TORCH_ARG(double, search_range_m) = 32;
  /// The chunk-size search interval; 0: 1024.
  TORCH_ARG(int64_t, hidden_dim) = 0;
  TORCH_ARG(double, min_chunk_size_m) = 32;
  /// Loss scaler (fp16).
  TORCH_ARG(double, initial_scale) = 65536.0;
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 1000;
  TORCH_ARG(int64_t, hysteresis) = 2;
  TORCH_ARG(double, max_scale) = 4294967296.0;
  /// Gradient clipping inside step(); 0: none.
  TORCH_ARG(double, max_norm) = 0.0;
  TORCH_ARG(double, norm_type) = 2.0;
  /// Only 1 is supported (tensor parallelism is HybridParallelPlugin's).
  TORCH_ARG(int, tp_size) = 1;
  /// Copies of the sharded model states: the data-parallel ranks form
  /// extra_dp_size groups of consecutive ranks (a node, say), each group
  /// shards one copy of the chunks, and the copies all-reduce their
  /// reduce-scattered gradient shards (hybrid sharding: 1 / (world /
  /// extra_dp_size) of the states per rank, the heavy gathers and
  /// reduce-scatters within a group). ColossalAI's mesh puts a copy's ranks
  /// extra_dp_size apart instead; only the placement of ranks differs.
  /// Must divide the data-parallel size.
  TORCH_ARG(int, extra_dp_size) = 1;
  /// Reduce-scatters overlap the rest of backward (always true here).
  TORCH_ARG(bool, enable_async_reduce) = true;
  /// An addition (NOTE [Host steps overlap the backward]): HybridAdam
  /// updates each chunk whose fp32 shard lives on the host as soon as its
  /// gradient has reached the host, on a background thread, and uploads
  /// its new weights while the device computes the rest of the backward;
  /// step() updates the rest. Static placement then puts the last chunks
  /// on the host (the first the backward completes). The update is step()'s
  /// arithmetic, bit for bit where the same chunks are on the host. Needs
  /// HybridAdam, max_norm 0, precision bf16 or fp32, one backward per step
  /// (not enable_gradient_accumulation), and the learning rate set before
  /// the backward.
  TORCH_ARG(bool, overlap_host_step) = false;
  /// Chunk all-gathers travel as FP8 (e4m3) and gradient reduce-scatters
  /// as FP8 (e5m2) where the data-parallel group spans more than one node:
  /// weights computed with are rounded to 8 bits, the fp32 shards stay
  /// exact, checkpoints hold them (zero::FullyShardedOptions::
  /// fp8_communication). Needs LibTorch 2.1 or later.
  TORCH_ARG(bool, fp8_communication) = false;
  /// FP8 mixed precision (ColossalAI's use_fp8): inside the model's
  /// forward, each linear layer whose weight trains multiplies in FP8
  /// (e4m3 operands, e5m2 output gradients, one scale per tensor, float32
  /// accumulation; quantization/fp8_linear.h). Layers of
  /// colossalai::shardformer::layer and models and
  /// colossalai::quantization::linear take part; LibTorch's own
  /// torch::nn::Linear cannot (a warning after the first forward says when
  /// nothing took part). Needs precision bf16 or fp16, LibTorch 2.1 or
  /// later, and on a GPU compute capability 8.9 or later.
  TORCH_ARG(bool, use_fp8) = false;
  /// Host-resident chunk data (fp32 shards, gradient shards, optimizer
  /// states, offloaded parameter shards) is page-locked on a CUDA device,
  /// so its transfers run asynchronously at the bus's speed: ColossalAI's
  /// pin_memory(true), the default here. ColossalAI's default, false, is
  /// refused on a CUDA device (pageable transfers block the host and stage
  /// through a copy; the overlapped host step needs asynchronous ones) and
  /// accepted on the CPU, where nothing is pinned.
  TORCH_ARG(bool, pin_memory) = true;
  /// Floating-point tensors the model's forward returns (alone, or in a
  /// tuple, pair or vector) are cast to float32, differentiably: a loss
  /// computed from them then runs in float32.
  TORCH_ARG(bool, force_outputs_fp32) = false;
  /// ColossalAI replicates tensor-parallel parameters whole under it; here
  /// Gemini's parameters are always whole (tp_size 1), so either value
  /// runs the same. The chunks stay sharded over the ranks.
  TORCH_ARG(bool, strict_ddp_mode) = false;
  /// Accepted for compatibility.
  TORCH_ARG(bool, verbose) = false;
};

/// Gemini: chunk-based ZeRO-3. Parameters are packed in execution order
/// into fixed-size chunks (NOTE [Gemini chunks]), each sharded over the
/// data-parallel ranks and gathered while a module using it computes; a
/// chunk is the unit of all-gather, reduce-scatter and placement between
/// the device and the host (NOTE [Gemini placement]). It runs on
/// the FSDP engine (FullyShardedOptions::chunk_size), so clipping, loss
/// scaling and checkpoints (full tensors, loadable at any world
/// size and under every plugin) are FSDP's. Chunks gather per module that
/// opens a ForwardScope (colossalai::nn::HookableModule, e.g. the blocks of
/// colossalai::models); the rest of the model's parameters are gathered for
/// the whole forward.
///
/// Placement (NOTE [Gemini placement]): "static" places chunks by the
/// fractions; "auto" keeps model states on the host and caches parameter
/// shards on the device within a budget measured against the non-model
/// memory of the first step. `FullyShardedModel::placement_stats()` (the
/// engine inside the boosted model) reports the tiers, the peak and the
/// bytes moved.
///
/// Example:
/// \code
///   auto plugin = std::make_shared<GeminiPlugin>(
///       GeminiPluginOptions().precision("bf16").max_norm(1.0));
///   Booster booster(BoosterOptions().plugin(plugin));
///   auto boosted = booster.boost(model, optimizer, criterion);
///
///   // A model whose states exceed the device: auto placement in 8 GiB.
///   auto big = std::make_shared<GeminiPlugin>(
///       GeminiPluginOptions()
///           .precision("bf16")
///           .placement_policy("auto")
///           .device_memory_capacity(int64_t(8) << 30));
/// \endcode
class GeminiPlugin : public DPPluginBase {
 public:
  explicit GeminiPlugin(GeminiPluginOptions options = {});

  std::string name() const override {
    return "GeminiPlugin";
  }
  std::vector<std::string> supported_devices() const override {
    return {"cpu", "cuda"};
  }
  std::vector<std::string> supported_precisions() const override {
    return {"fp16", "bf16", "fp32"};
  }
  bool control_precision() const override {
    return true;
  }
  std::string precision() const override {
    return gemini_.precision();
  }
  bool control_device() const override {
    return true;
  }
  bool support_no_sync() const override {
    return false;
  }
  bool shards_lazy_models() const override {
    return true;
  }
  bool control_checkpoint_io() const override {
    return true;
  }
  std::shared_ptr<checkpoint_io::CheckpointIO> get_checkpoint_io() override;
  void configure(
      std::shared_ptr<interface::ModelWrapper>& model,
      std::shared_ptr<interface::OptimizerWrapper>& optimizer) override;
  const GeminiPluginOptions& gemini_options() const {
    return gemini_;
  }

 private:
  GeminiPluginOptions gemini_;
  // What Gemini asks of FSDP's engine: chunks as units, their placement.
  zero::FullyShardedOptions engine_;
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
