#pragma once

#include <colossalai/checkpoint_io/checkpoint_io_base.h>

#include <ATen/core/ivalue.h>

#include <functional>
#include <map>
#include <set>

namespace colossalai {
namespace checkpoint_io {

namespace detail {
class ShardedCommit;
} // namespace detail

/// Receives a model's full tensors by name, a few at a time.
using TensorSink =
    std::function<void(const std::string& name, const at::Tensor& tensor)>;
/// Receives one parameter's full optimizer state by parameter id.
using StateSink = std::function<void(int64_t id, const StateDict& state)>;

/// How a plugin's model and optimizer state reach a checkpoint and come
/// back: the one part of checkpoint IO a sharding plugin changes. The
/// defaults read and write the module's and optimizer's own tensors (one
/// process, DDP); ZeRO and FSDP gather their shards to the writer one bucket
/// or unit at a time and keep their own slice on load.
/// Copies checkpoint tensor `src` (key `key`, read from `file`) into a
/// model tensor the default copy cannot handle; false: not handled.
using TensorLoader = std::function<bool(
    const std::string& key,
    const at::Tensor& src,
    const std::string& file)>;

class StateAccess {
 public:
  virtual ~StateAccess() = default;

  /// Hands the model's full tensors to `sink` (collective where sharded;
  /// the sink may run on the writer only).
  virtual void stream_model(
      interface::ModelWrapper& model,
      const TensorSink& sink);
  /// Hands full per-parameter optimizer states to `sink` (as stream_model).
  virtual void stream_optimizer(
      interface::OptimizerWrapper& optimizer,
      const StateSink& sink);
  /// Takes the checkpoint tensors the module does not hold whole (a
  /// tensor-parallel shard is cut from the full tensor and copied), so a
  /// load never materialises the whole model; returns false for the keys
  /// the default copy handles. Null (the default): every tensor is whole.
  virtual TensorLoader model_tensor_loader(interface::ModelWrapper& model);
  /// Runs `load`, which copies checkpoint tensors into the module's own
  /// tensors, in the scope the plugin needs (FSDP: parameters gathered, then
  /// written back to the shards; ZeRO: master weights re-read after).
  virtual void load_model(
      interface::ModelWrapper& model,
      const std::function<void()>& load);
  /// Restores one parameter's full state (a sharding plugin keeps its part).
  virtual void load_optimizer_param(
      interface::OptimizerWrapper& optimizer,
      int64_t id,
      const StateDict& state,
      const std::string& file);
  /// The param groups a checkpoint stores: hyperparameters and the ids of
  /// the whole model's parameters (a pipeline stage's optimizer holds only
  /// some of them).
  virtual c10::impl::GenericList optimizer_param_groups(
      interface::OptimizerWrapper& optimizer);
  /// Restores the groups' hyperparameters from a checkpoint's
  /// `param_groups` (checks they match the model's groups).
  virtual void load_optimizer_groups(
      interface::OptimizerWrapper& optimizer,
      const c10::IValue& groups,
      const std::string& file);

  /// Sharded saves in parts (NOTE [Sharded saves in parts]): the group ranks
  /// that each write one part of a sharded checkpoint, in part order (one
  /// per pipeline stage). Empty (the default): one writer writes it all.
  virtual std::vector<int> part_writers();
  /// This rank's part of the model's full tensors (collective among the
  /// part's ranks; the sink may run on the part's writer only).
  virtual void stream_model_part(
      interface::ModelWrapper& model,
      const TensorSink& sink);
  /// As stream_model_part, for per-parameter optimizer states.
  virtual void stream_optimizer_part(
      interface::OptimizerWrapper& optimizer,
      const StateSink& sink);
};

/// Checkpoints of a model and optimizer held whole by this process (plain
/// training and DDP).
///
/// Files, readable by Python (`torch.load`, `safetensors`, Hugging Face):
///  - model, unsharded: one `.safetensors` or `.bin` file at the given path;
///  - model, sharded: a directory of `model-0000i-of-0000n.safetensors`
///    (or `pytorch_model-...bin`) files plus `model.safetensors.index.json`
///    (`pytorch_model.bin.index.json`);
///  - optimizer, unsharded: one `.bin` holding {"state", "param_groups"} as
///    `torch.optim.Optimizer.state_dict()` does;
///  - optimizer, sharded: `pytorch_optim-0000i-of-0000n.bin` shards of
///    {param_id: state}, `pytorch_optim_group.bin` and
///    `pytorch_optim.bin.index.json` (ColossalAI's layout);
///  - LR scheduler: a LibTorch archive.
///
/// Example:
/// \code
///   GeneralCheckpointIO io;
///   io.save_model(*boosted.model.wrapper(), "ckpt/model",
///                 SaveModelOptions().shard(true).use_safetensors(true));
///   io.load_model(*boosted.model.wrapper(), "ckpt/model");
/// \endcode
class GeneralCheckpointIO : public CheckpointIO {
 protected:
  /// Set by subclasses around a load (StateAccess::model_tensor_loader).
  TensorLoader tensor_loader_;

 protected:
  void save_unsharded_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      const SaveModelOptions& options) override;
  void save_sharded_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      const SaveModelOptions& options) override;
  void load_unsharded_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      bool strict) override;
  void load_sharded_model(
      interface::ModelWrapper& model,
      const std::string& index_file,
      bool strict) override;
  void save_unsharded_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint,
      const SaveOptimizerOptions& options) override;
  void save_sharded_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint,
      const SaveOptimizerOptions& options) override;
  void load_unsharded_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint) override;
  void load_sharded_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& index_file) override;

  using TensorSink = checkpoint_io::TensorSink;
  using StateSink = checkpoint_io::StateSink;
  /// Hands the model's full tensors to `sink`, a few at a time, on the
  /// writer (collective where parameters are sharded: every rank calls it,
  /// the sink may run on the writer only). Sharded saves write shard files
  /// as tensors arrive, so the writer never holds the whole model. Default:
  /// the module's own tensors.
  virtual void stream_model_state(
      interface::ModelWrapper& model,
      const TensorSink& sink);
  /// As stream_model_state, for full per-parameter optimizer states.
  /// Default: the optimizer's own states.
  virtual void stream_optimizer_states(
      interface::OptimizerWrapper& optimizer,
      const StateSink& sink);
  /// Restores one parameter's full state (a sharding plugin keeps its slice).
  virtual void load_optimizer_state(
      interface::OptimizerWrapper& optimizer,
      int64_t id,
      const StateDict& state,
      const std::string& file);
  /// StateAccess::optimizer_param_groups / load_optimizer_groups.
  virtual c10::impl::GenericList optimizer_param_groups(
      interface::OptimizerWrapper& optimizer);
  virtual void load_optimizer_groups(
      interface::OptimizerWrapper& optimizer,
      const c10::IValue& groups,
      const std::string& file);

  /// Sharded saves in parts: how many parts (1: the writer writes all),
  /// which one this rank writes (-1: none), the part's state, and a
  /// blocking exchange of small messages among the ranks (every rank's
  /// `bytes`, in rank order).
  virtual int num_parts();
  virtual int my_part();
  virtual void stream_model_part(
      interface::ModelWrapper& model,
      const TensorSink& sink);
  virtual void stream_optimizer_part(
      interface::OptimizerWrapper& optimizer,
      const StateSink& sink);
  virtual std::vector<std::string> exchange(const std::string& bytes);

 private:
  // Writes a sharded checkpoint in num_parts() parts and commits one index
  // (every rank calls it): `write_part` streams this rank's part into
  // `part` (null where this rank writes none) and records a write error in
  // `error` instead of throwing, so the part's collectives complete;
  // `finish` adds extras and commits, on the writer.
  void save_in_parts(
      const std::string& dir,
      const std::string& index_name,
      const std::string& stem,
      int64_t max_bytes,
      const std::function<
          void(detail::ShardedCommit* part, std::string& error)>& write_part,
      const std::function<void(detail::ShardedCommit& commit)>& finish);
};

/// The module's parameters and buffers under their dotted names.
StateDict model_state_dict(torch::nn::Module& module);

/// Copies `state` into the module's tensors. Shapes must match and dtypes
/// must be of the same kind (floating point may convert to another floating
/// point type). With `strict_unexpected`, every key of `state` must be the
/// module's. Everything refused is refused before anything is copied, so a
/// refused load leaves the module unchanged. `seen` collects the keys used,
/// for checks across several shard files.
/// `loader`, when set, is offered each key first (StateAccess::
/// model_tensor_loader).
void load_model_state(
    torch::nn::Module& module,
    const StateDict& state,
    const std::string& file,
    std::set<std::string>* seen = nullptr,
    bool strict_unexpected = true,
    const TensorLoader& loader = nullptr);

} // namespace checkpoint_io
} // namespace colossalai
