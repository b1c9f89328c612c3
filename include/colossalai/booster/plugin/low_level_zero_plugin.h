#pragma once

#include <colossalai/booster/plugin/dp_plugin_base.h>
#include <colossalai/zero/low_level_optimizer.h>

#include <torch/arg.h>

namespace colossalai {
namespace booster {
namespace plugin {

/// Options of LowLevelZeroPlugin, with ColossalAI's names and defaults.
struct LowLevelZeroPluginOptions {
  TORCH_ARG(int, stage) = 1;
  /// "fp16" (needs CUDA), "bf16" or "fp32".
  TORCH_ARG(std::string, precision) = "fp16";
  TORCH_ARG(double, initial_scale) = 4294967296.0;
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 1000;
  TORCH_ARG(int64_t, hysteresis) = 2;
  TORCH_ARG(double, max_scale) = 4294967296.0;
  /// Global gradient-norm clipping inside step; 0 = off. Only norm 2.
  TORCH_ARG(double, max_norm) = 0.0;
  TORCH_ARG(double, norm_type) = 2.0;
  /// Gradient bucket size in units of 2^20 elements (as ColossalAI).
  TORCH_ARG(double, reduce_bucket_size_in_m) = 12;
  /// "" (the working dtype), "fp32", "bf16" or "fp16". With bf16 weights
  /// the gradient slices are kept in it too: bf16 by default (ColossalAI's
  /// layout, 2 bytes per parameter less), "fp32" for float32 slices that
  /// accumulate over backwards in float32 (NOTE [Gradient shards in bf16]).
  TORCH_ARG(std::string, communication_dtype) = "";
  /// Start each gradient bucket's reduction from backward hooks.
  TORCH_ARG(bool, overlap_communication) = true;
  /// Leave the parameter all-gathers of step() in flight: the next forward
  /// waits for each bucket as the first module holding its parameters
  /// begins (each `colossalai::nn::HookableModule`, e.g. a transformer
  /// block; parameters outside every such module before the forward), so
  /// they overlap the forward's first layers. Read the weights any other
  /// way only after `boosted.model.wrapper()->synchronize_weights()`
  /// (checkpoints and the next step wait by themselves). NOTE [All-gathers
  /// overlap the next forward].
  TORCH_ARG(bool, overlap_allgather) = false;
  /// Parameter all-gathers (e4m3) and gradient reduce-scatters (e5m2)
  /// travel as FP8 where the data-parallel group spans more than one node:
  /// the forward sees weights rounded to 8 bits (within 2^-4 of the
  /// masters, which stay exact), the optimizer gradients within 2^-3 of
  /// each rank's contribution (LowLevelZeroOptimizerOptions::
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
  /// Master slices, gradient slices and optimizer states in host memory;
  /// pass a HybridAdam for the fused CPU update.
  TORCH_ARG(bool, cpu_offload) = false;
  /// An addition, with cpu_offload (NOTE [Host steps overlap the
  /// backward]): HybridAdam updates each bucket's host master slice as soon
  /// as its gradient has reached the host, on a background thread, while
  /// the device computes the rest of the backward (at one rank the
  /// bucket's weights are uploaded then too); step() waits for them. The
  /// weights are the same bit for bit. Needs HybridAdam, max_norm 0,
  /// precision bf16 or fp32, one synchronising backward per step (no_sync
  /// backwards before it are fine), and the learning rate set before the
  /// backward.
  TORCH_ARG(bool, overlap_host_step) = false;
  /// Only true is supported (the optimizer always updates fp32 slices).
  TORCH_ARG(bool, master_weights) = true;
  /// Accepted for compatibility; nothing extra is printed.
  TORCH_ARG(bool, verbose) = false;
  /// Floating-point tensors passed to the model's forward are cast to the
  /// working dtype (bf16 / fp16); false: they reach the model as given (a
  /// model that casts them itself, or keeps some inputs in float32).
  TORCH_ARG(bool, cast_inputs) = true;
  /// Copies of the sharded states, as ColossalAI's: the ranks form groups
  /// of world / extra_dp_size consecutive ranks (a node, say), each group
  /// shards one copy of the masters, gradients and optimizer states, and
  /// the copies all-reduce their reduce-scattered gradient slices (hybrid
  /// sharding). Must divide the world size.
  TORCH_ARG(int, extra_dp_size) = 1;
};

/// ZeRO-1/2 data parallelism: optimizer states (and with stage 2 gradients)
/// sharded over the data-parallel ranks. See NOTE [ZeRO-1/2 layout].
///
/// Example:
/// \code
///   auto plugin = std::make_shared<LowLevelZeroPlugin>(
///       LowLevelZeroPluginOptions().stage(2).precision("bf16"));
///   Booster booster(BoosterOptions().plugin(plugin));
///   auto boosted = booster.boost(model, optimizer, criterion);
/// \endcode
class LowLevelZeroPlugin : public DPPluginBase {
 public:
  explicit LowLevelZeroPlugin(LowLevelZeroPluginOptions options = {});

  std::string name() const override {
    return "LowLevelZeroPlugin";
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
    return options_.precision();
  }
  bool control_device() const override {
    return true;
  }
  bool support_no_sync() const override {
    return options_.stage() == 1;
  }
  bool support_lora() const override {
    return true;
  }
  bool control_checkpoint_io() const override {
    return true;
  }
  std::shared_ptr<checkpoint_io::CheckpointIO> get_checkpoint_io() override;
  void configure(
      std::shared_ptr<interface::ModelWrapper>& model,
      std::shared_ptr<interface::OptimizerWrapper>& optimizer) override;
  NoSyncGuard no_sync(
      interface::ModelWrapper& model,
      interface::OptimizerWrapper* optimizer) override;

  const LowLevelZeroPluginOptions& options() const {
    return options_;
  }

 private:
  LowLevelZeroPluginOptions options_;
  at::ScalarType dtype_;
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
