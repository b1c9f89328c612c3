#pragma once

#include <colossalai/checkpoint_io/state_dict.h>
#include <colossalai/interface/model.h>
#include <colossalai/interface/optimizer.h>

#include <torch/arg.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace colossalai {
namespace nn {
namespace lr_scheduler {
class LRScheduler;
} // namespace lr_scheduler
} // namespace nn

namespace checkpoint_io {

/// Options of `save_model` (`Booster.save_model`'s keyword arguments).
struct SaveModelOptions {
  /// A directory of shard files plus a Hugging Face index, instead of one
  /// file.
  TORCH_ARG(bool, shard) = false;
  /// Gather distributed tensors into full ones before saving; only true is
  /// supported (false is refused with an error).
  TORCH_ARG(bool, gather_dtensor) = true;
  /// Inserted into file names: "model.<prefix>.safetensors".
  TORCH_ARG(std::string, prefix) = "";
  /// Largest shard, in MB (a larger single tensor gets a shard of its own).
  TORCH_ARG(int64_t, size_per_shard) = 1024;
  /// safetensors instead of PyTorch `.bin`.
  TORCH_ARG(bool, use_safetensors) = false;
  /// Snapshot the tensors and write them from a background thread. The
  /// caller waits only for the snapshot, a copy into host buffers that the
  /// CheckpointIO keeps for its next async save (so only the first one pays
  /// for fresh memory; the buffers hold one copy of the saved state).
  TORCH_ARG(bool, use_async) = false;
};

/// Options of `save_optimizer`.
struct SaveOptimizerOptions {
  TORCH_ARG(bool, shard) = false;
  /// Only true is supported (see SaveModelOptions).
  TORCH_ARG(bool, gather_dtensor) = true;
  TORCH_ARG(std::string, prefix) = "";
  TORCH_ARG(int64_t, size_per_shard) = 1024;
  TORCH_ARG(bool, use_async) = false;
};

/// Saves and loads models, optimizers and LR schedulers
/// (`colossalai.checkpoint_io.CheckpointIO`). `load_model` and
/// `load_optimizer` recognise sharded checkpoints by their index file, so one
/// call loads either kind. Plugins return their own subclass.
///
/// Every save is atomic: a process killed at any point leaves the previous
/// or the new checkpoint, loadable by its path (and, sharded, by its
/// directory or index). A sharded save into a directory replaces only its
/// own index and the files that index names; other files (another prefix,
/// the optimizer beside the model, the user's own) are never touched.
class CheckpointIO {
 public:
  virtual ~CheckpointIO();

  void save_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      const SaveModelOptions& options = {});
  void load_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      bool strict = true);
  void save_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint,
      const SaveOptimizerOptions& options = {});
  void load_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint);
  virtual void save_lr_scheduler(
      const nn::lr_scheduler::LRScheduler& scheduler,
      const std::string& checkpoint);
  virtual void load_lr_scheduler(
      nn::lr_scheduler::LRScheduler& scheduler,
      const std::string& checkpoint);

  /// Waits for the background save in flight (use_async) and rethrows its
  /// error, if any.
  void synchronize();

  /// Runs `load`, which writes into the module's own tensors (a training
  /// checkpoint's LoRA adapters), in the scope the plugin needs: after it,
  /// ZeRO re-reads its master weights from the loaded ones, which its next
  /// step would otherwise write back over them.
  void load_model_tensors(
      interface::ModelWrapper& model,
      const std::function<void()>& load);

 protected:
  /// Whether this process writes files (e.g. only rank 0 under DDP). Every
  /// rank runs the save_* methods (they may gather state); only writers write.
  virtual bool is_writer() const {
    return true;
  }
  /// Where processes meet: after each save, and before each load, so files
  /// are complete before anyone reads them.
  virtual void sync_point() {}
  /// load_model_tensors' scope (the plugin's StateAccess::load_model).
  virtual void load_in_model_scope(
      interface::ModelWrapper& model,
      const std::function<void()>& load) {
    (void)model;
    load();
  }

  virtual void save_unsharded_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      const SaveModelOptions& options) = 0;
  virtual void save_sharded_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      const SaveModelOptions& options) = 0;
  virtual void load_unsharded_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      bool strict) = 0;
  virtual void load_sharded_model(
      interface::ModelWrapper& model,
      const std::string& index_file,
      bool strict) = 0;
  virtual void save_unsharded_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint,
      const SaveOptimizerOptions& options) = 0;
  virtual void save_sharded_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint,
      const SaveOptimizerOptions& options) = 0;
  virtual void load_unsharded_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint) = 0;
  virtual void load_sharded_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& index_file) = 0;

  /// Runs `job` now, or in the background when `async` (after the previous
  /// background job finished; its error is rethrown here first).
  void run_maybe_async(bool async, std::function<void()> job);

  /// An owned host copy of `t` for a background save, in a buffer reused
  /// from the previous async save when one fits (save_model and
  /// save_optimizer wait for the previous background save before a new
  /// snapshot starts).
  at::Tensor snapshot(const at::Tensor& t);
  StateDict snapshot(const StateDict& state);

 private:
  std::thread writer_;
  std::exception_ptr writer_error_;
  // Snapshot buffers, taken in order by each async save (NOTE above).
  std::vector<c10::Storage> snapshot_buffers_;
  size_t snapshot_cursor_ = 0;
};

} // namespace checkpoint_io
} // namespace colossalai
