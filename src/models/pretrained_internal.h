#pragma once

// What the families' from_pretrained / save_pretrained share: reading a
// Hugging Face directory's config and weights into a module under renamed
// keys, every size compared with the weight files' headers before the model
// is allocated, and writing a module's tensors as one file or shards plus an
// index.

#include <colossalai/models/pretrained.h>

#include "models/config_fields.h"

#include <colossalai/lazy/lazy_init.h>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace colossalai {
namespace models {
namespace detail {

/// config.json's text: `dir`/config.json must be a regular file of at most
/// 64 MiB (throws naming the directory when it is absent).
std::string read_config_json(const std::string& dir);

/// The dtype config.json names (`dtype`, or `torch_dtype`), float32 when it
/// names none or "auto".
at::ScalarType config_dtype(const std::string& json);

/// Rethrows an error met reading `dir`'s config.json ("config.json: ...")
/// naming the file's path.
[[noreturn]] void rethrow_naming_config(
    const std::string& dir,
    const c10::Error& e);

/// A family's config read from `dir`/config.json by `from_json`.
template <class Config>
Config read_pretrained_config(
    const std::string& dir,
    Config (*from_json)(const std::string&)) {
  const auto text = read_config_json(dir);
  try {
    return from_json(text);
  } catch (const c10::Error& e) {
    rethrow_naming_config(dir, e);
  }
}

/// Maps a checkpoint key to the module's name; "" skips the tensor.
using KeyMap = std::function<std::string(const std::string&)>;

/// One tensor of a directory's weights: its checkpoint key, the file it is
/// taken from and a view of its bytes (files are memory-mapped: nothing is
/// read until it is copied).
struct CheckpointTensor {
  std::string key;
  std::string file;
  at::Tensor value;
};

/// The weights of `dir` (model.safetensors, the sharded safetensors index,
/// pytorch_model.bin or its index), every header read and checked against
/// its file. A sharded checkpoint's key is taken from the shard its index
/// names, whatever other shards hold; a key whose shard lacks it is listed
/// in `unheld` ("key (shard)").
struct CheckpointTensors {
  std::vector<CheckpointTensor> tensors;
  std::vector<std::string> unheld;
};
CheckpointTensors open_pretrained_weights(const std::string& dir);

/// The shape and dtype of each parameter and buffer of a module.
using TensorSpecs =
    std::map<std::string, std::pair<std::vector<int64_t>, at::ScalarType>>;
/// The specs of the module `build` makes, built in a LazyInitContext:
/// nothing is allocated, nothing is kept.
TensorSpecs lazy_tensor_specs(
    const std::function<std::shared_ptr<torch::nn::Module>()>& build);

/// A config's count of layers and the field that gave it.
struct LayerCount {
  int64_t value;
  const char* field;
};
/// Refuses more layers than `weights` hold tensors (every layer has at
/// least one) where they are too many to build even lazily in a moment
/// (above 256).
void check_layer_count(
    const std::string& dir,
    const CheckpointTensors& weights,
    const LayerCount& layers);

/// Module tensor names with the checkpoint tensors they take, in file
/// order.
using LoadPlan = std::vector<std::pair<std::string, at::Tensor>>;

/// The checkpoint tensor each module tensor of `specs` takes under `map`:
/// shapes and kinds (floating or not) must match; with `strict`, keys the
/// module lacks, module tensors the weights lack and keys the index names
/// but no shard holds are errors naming them. Runs before any model is
/// allocated.
LoadPlan plan_pretrained_load(
    const std::string& dir,
    const CheckpointTensors& weights,
    const TensorSpecs& specs,
    const KeyMap& map,
    bool strict);

/// Fills `module`, built in a LazyInitContext, from `plan` in `dtype`: each
/// planned tensor is allocated in `dtype` and read from its file (pread, or
/// a copy through the mapping whose pages are then let go), the rest are
/// materialised and cast, as `module->to(dtype)` would. Each view is
/// dropped once read, so a file's mapping goes when its last tensor is in;
/// the peak is the model in `dtype` plus about one tensor.
void load_planned_weights(
    torch::nn::Module& module,
    LoadPlan&& plan,
    at::ScalarType dtype);

/// Writes `module`'s parameters and buffers (Hugging Face names) into
/// `dir` as transformers does, and `config_json` as config.json.
void save_pretrained_module(
    torch::nn::Module& module,
    const std::string& config_json,
    const std::string& dir,
    const SavePretrainedOptions& options);

/// Writes `dir`/config.json (creating `dir`), through a temporary file.
void write_config_json(const std::string& dir, const std::string& json);

inline bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
      s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// A config's `source_json` as the object config_to_json writes over (an
/// empty one for a config not read from a file).
nlohmann::json source_fields(const std::string& source_json);

/// `config_json` with "dtype" set to the module's parameter dtype, as
/// transformers writes it.
std::string with_dtype(const std::string& config_json, torch::nn::Module& m);

/// from_pretrained's steps: the weights' headers read, the model of
/// `config` checked against them without allocating it (its tensors'
/// shapes from a lazy build), then built in the dtype `options` or
/// config.json ask for and filled from `dir`'s weights under `map`'s names.
template <class M, class Config>
M load_pretrained_model(
    const std::string& dir,
    const Config& config,
    const LayerCount& layers,
    const FromPretrainedOptions& options,
    const KeyMap& map) {
  at::ScalarType dtype = at::kFloat;
  try {
    dtype =
        options.dtype() ? *options.dtype() : config_dtype(config.source_json());
  } catch (const c10::Error& e) {
    rethrow_naming_config(dir, e);
  }
  LoadPlan plan;
  {
    const auto weights = open_pretrained_weights(dir);
    check_layer_count(dir, weights, layers);
    plan = plan_pretrained_load(
        dir,
        weights,
        lazy_tensor_specs([&] { return M(config).ptr(); }),
        map,
        options.strict());
  }
  // Built lazily, then filled in `dtype`: never whole in float32.
  M model{nullptr};
  {
    lazy::LazyInitContext context;
    model = M(config);
  }
  load_planned_weights(*model, std::move(plan), dtype);
  return model;
}

/// save_pretrained's steps: config.json (with the model's dtype) and the
/// weights. `config_to_json` of the model's config is found by its type.
template <class M>
void save_pretrained_model(
    M& model,
    const std::string& dir,
    const SavePretrainedOptions& options) {
  save_pretrained_module(
      *model,
      with_dtype(config_to_json(model->config()), *model),
      dir,
      options);
}

} // namespace detail
} // namespace models
} // namespace colossalai
