#pragma once

#include <colossalai/interface/model.h>
#include <colossalai/interface/optimizer.h>
#include <colossalai/pipeline/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace checkpoint_io {
class CheckpointIO;
} // namespace checkpoint_io

namespace booster {
namespace plugin {

/// RAII scope returned by `no_sync`: gradient synchronization is off until it
/// is destroyed.
class NoSyncGuard {
 public:
  NoSyncGuard() = default;
  explicit NoSyncGuard(std::function<void()> on_exit)
      : on_exit_(std::move(on_exit)) {}
  NoSyncGuard(NoSyncGuard&& other) noexcept
      : on_exit_(std::move(other.on_exit_)) {
    other.on_exit_ = nullptr;
  }
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  NoSyncGuard(const NoSyncGuard&) = delete;
  ~NoSyncGuard() {
    if (on_exit_) {
      on_exit_();
    }
  }

 private:
  std::function<void()> on_exit_;
};

/// A parallel strategy (`colossalai.booster.plugin.Plugin`). Capabilities a
/// plugin lacks fail with a message naming the plugin and the feature.
class Plugin {
 public:
  virtual ~Plugin() = default;

  virtual std::string name() const = 0;
  /// "cpu", "cuda".
  virtual std::vector<std::string> supported_devices() const = 0;
  /// "fp16", "bf16", "fp32".
  virtual std::vector<std::string> supported_precisions() const = 0;
  /// Whether the plugin applies mixed precision itself (else the Booster
  /// does).
  virtual bool control_precision() const = 0;
  /// The precision a plugin that controls precision trains in ("fp16",
  /// "bf16", "fp32"). A Booster mixed_precision that differs is refused: the
  /// plugin would silently train in its own.
  virtual std::string precision() const {
    return "";
  }
  /// Whether the plugin moves the model to its device itself.
  virtual bool control_device() const = 0;
  /// This rank's index among the data-parallel ranks and their number: what
  /// picks each rank's share of the batch (`DistributedSampler(n, dp_size(),
  /// dp_rank())`). Ranks of one tensor, pipeline or sequence group share a
  /// data-parallel rank and so the same batch. A plugin without data
  /// parallelism: rank 0 of 1 (every rank takes the whole batch).
  virtual int dp_rank() const {
    return 0;
  }
  virtual int dp_size() const {
    return 1;
  }
  virtual bool support_no_sync() const = 0;
  virtual bool support_lora() const {
    return false;
  }
  /// Which of this plugin's settings refuses LoRA when support_lora() is
  /// false for a plugin that trains LoRA under other settings (e.g.
  /// "tp_size 2 > 1 (...)"), for the refusal's message; "": the plugin never
  /// trains LoRA.
  virtual std::string lora_refusal() const {
    return "";
  }
  /// Whether the plugin materialises a model built in a LazyInitContext
  /// itself, keeping only this rank's shard; otherwise boost materialises
  /// it whole first.
  virtual bool shards_lazy_models() const {
    return false;
  }
  virtual bool control_checkpoint_io() const {
    return false;
  }
  virtual std::shared_ptr<checkpoint_io::CheckpointIO> get_checkpoint_io();

  /// Wraps the model and optimizer for this strategy (either may be null).
  virtual void configure(
      std::shared_ptr<interface::ModelWrapper>& model,
      std::shared_ptr<interface::OptimizerWrapper>& optimizer) = 0;

  /// Turns gradient synchronization off for the guard's lifetime.
  virtual NoSyncGuard no_sync(
      interface::ModelWrapper& model,
      interface::OptimizerWrapper* optimizer);

  /// Whether the plugin runs pipelines (`execute_pipeline`).
  virtual bool support_pipeline() const {
    return false;
  }
  /// One training step of a pipelined model: forward and backward of every
  /// micro-batch, gradients synchronised (ColossalAI's
  /// PipelinePluginBase.execute_pipeline).
  virtual pipeline::PipelineOutput execute_pipeline(
      const pipeline::DataIterator& data_iter,
      interface::ModelWrapper& model,
      const pipeline::PipelineCriterion& criterion,
      interface::OptimizerWrapper* optimizer,
      bool return_loss,
      bool return_outputs);

  /// Adds LoRA adapters to the model.
  virtual std::shared_ptr<torch::nn::Module> enable_lora(
      std::shared_ptr<torch::nn::Module> model,
      const std::string& pretrained_dir = "");

 protected:
  [[noreturn]] void unsupported(const std::string& feature) const;
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
